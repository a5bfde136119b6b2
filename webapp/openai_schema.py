"""OpenAI request parsing and response shapes, without I/O (the routes are in :mod:`webapp.openai_api`).

Only what this service can honour is accepted; anything else is a clear 400 rather than silently ignored
(token-id prompts; every field of a chat or completions body: :mod:`webapp.openai_fields`).

Log-probabilities come from the worker (``logprobs`` entries in each item's output: token, logprob, the
likeliest tokens; with ``echo`` the prompt's too) and are only shaped here: OpenAI's legacy object on
completions (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), its ``content`` list on chat.
The worker computes them in one pass once a row has finished, so on a stream a choice's whole list comes in its
last chunk (the one with its ``finish_reason``); clients that join the chunks' lists get the same list as
without ``stream``.

``n`` choices of one prompt are ``n`` items of the call, each through the same caps, fairness and token budget
as any other item; with a ``seed``, choice ``j`` samples with ``seed + j`` (see
:func:`tasks.policy.batcher.choice_params`), so a seeded call gives the same ``n`` different samples each time,
and its first choice is what the same call with ``n=1`` gives.
"""
from __future__ import annotations

import base64
import json
import math
import struct
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tasks.config import Settings
from tasks.errors import InvalidInput
from tasks.gateway.calls import Call
from tasks.schema import NO_PARAMS, ItemResult, SamplingParams, bounds, json_integer
from webapp import openai_fields
from webapp.openai_tools import chat_choice, chat_messages, constraint
from webapp.validation import check_model, timeout_limit_ms

MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # OpenAI's limits: completions' logprobs, chat's top_logprobs


@dataclass(frozen=True)
class Streaming:
    """How a streamed call's chunks go out (a call that does not stream has none)."""

    include_usage: bool = False  # stream_options.include_usage: every chunk says usage null, a last one the counts
    tier: str = ""  # the service_tier every chunk says (as its answer: Shape.tier; "": none asked for)


def streaming(body: dict[str, Any]) -> Streaming | None:
    """The body's ``stream`` and ``stream_options``, checked as OpenAI checks them."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidInput("'stream' must be true or false")
    if options is None:
        return Streaming() if stream else None
    if not stream:
        raise InvalidInput("'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise InvalidInput("'stream_options' must be an object with at most 'include_usage' (true or false)")
    return Streaming(include_usage=bool(options.get("include_usage")))


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidInput(f"'{name}' must be a number between {low:g} and {high:g}")
    return float(value)


def _common(body: Any, settings: Settings) -> tuple[str, dict[str, Any], int]:
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    model = check_model(body.get("model"))
    timeout_ms = _number(body, "timeout_ms", settings.admission.default_timeout_ms, 1, timeout_limit_ms(settings))
    return model, body, math.ceil(timeout_ms)  # up, never past a limit: 300000.0001 is over 300000


def _sampling(body: dict[str, Any], name: str) -> float:
    """A number field of :class:`SamplingParams` (its default when absent), within the range the field states."""
    low, high = bounds(name)["minimum"], bounds(name)["maximum"]
    return _number(body, name, float(getattr(NO_PARAMS, name)), low, high)


def generation_params(body: dict[str, Any], settings: Settings, *, default_max_tokens: int,
                      scoring: Scoring | None = None, chat: bool = False) -> SamplingParams:
    """The parameters every generation call passes to its worker; ``scoring`` those of :func:`scoring_params`
    (``echo`` lets ``max_tokens`` be 0: scoring a given text)."""
    scoring = scoring or Scoring()
    least, most = (0 if scoring.echo else 1), settings.models.max_tokens_cap
    given: dict[str, int] = {}
    for name in ("max_tokens", "max_completion_tokens"):  # both checked: the second wins, as OpenAI's does
        value = body.get(name)
        if value is None:
            continue
        count = json_integer(value)
        if count is None or not least <= count <= most:
            raise InvalidInput(f"'{name}' must be an integer from {least} to {most}"
                               + (" (0 only with 'echo', to score a given text)" if least else ""))
        given[name] = count
    max_tokens = given.get("max_completion_tokens", given.get("max_tokens", default_max_tokens))
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise InvalidInput("'stop' must be a string or a list of up to 4 non-empty strings")
    seed = _integer(body, "seed", None)  # checked in this order: a body with two wrong fields hears of the first
    return SamplingParams(max_tokens=max_tokens, temperature=_sampling(body, "temperature"),
                          top_p=_sampling(body, "top_p") or 1.0, stop=tuple(stop or ()), seed=seed,
                          logprobs=scoring.logprobs, echo=scoring.echo, n=choices(body), chat=chat,
                          **openai_fields.sampling(body))


def _integer(body: dict[str, Any], name: str, default: int | None) -> int | None:
    """An integer field of :class:`SamplingParams`, within the range the field states."""
    value = body.get(name)
    if value is None:
        return default
    low, high = int(bounds(name)["minimum"]), int(bounds(name)["maximum"])
    if (value := json_integer(value)) is None or not low <= value <= high:
        raise InvalidInput(f"'{name}' must be an integer from {low} to {high}")
    return value


def choices(body: dict[str, Any]) -> int:
    """The body's ``n``: how many choices to generate for each prompt."""
    return _integer(body, "n", 1) or 1


@dataclass(frozen=True)
class Scoring:
    """What a body asks of log-probabilities: ``logprobs`` (how many likeliest tokens at each position; None:
    none) and, on completions, ``echo``."""

    logprobs: int | None = None
    echo: bool = False


def scoring_params(body: dict[str, Any], *, chat: bool) -> Scoring:
    """What the body asks of log-probabilities (:class:`Scoring`), checked as each route checks it."""
    return _chat_scoring(body) if chat else _completion_scoring(body)


def _chat_scoring(body: dict[str, Any]) -> Scoring:
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidInput("'logprobs' must be true or false")
    if top is not None:
        top = json_integer(top)
        if top is None or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidInput(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        if not logprobs:
            raise InvalidInput("'top_logprobs' needs 'logprobs': true")
    if body.get("echo") is not None:
        raise InvalidInput("'echo' is a /v1/completions parameter")
    return Scoring(logprobs=top or 0) if logprobs else Scoring()


def _completion_scoring(body: dict[str, Any]) -> Scoring:
    logprobs, echo, count = body.get("logprobs"), body.get("echo"), None
    if logprobs is not None and logprobs is not False:  # false: none, as some clients send it
        count = json_integer(logprobs)
        if count is None or not 0 <= count <= MAX_COMPLETION_LOGPROBS:
            raise InvalidInput(f"'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidInput("'echo' must be true or false")
    return Scoring(logprobs=count, echo=bool(echo))


def _strings(body: dict[str, Any], name: str, settings: Settings, note: str = "") -> list[str]:
    """A field holding one string or a non-empty list of them (one batch item each)."""
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInput(f"'{name}' must be a string or a non-empty list of strings{note}")
    if len(texts) > settings.admission.max_inputs_per_call:
        raise InvalidInput(f"at most {settings.admission.max_inputs_per_call} '{name}' entries per call")
    return texts


def parse_completion(body: Any, settings: Settings, request_id: str, tenant: str) -> tuple[Call, Streaming | None]:
    """A /v1/completions body -> the call to submit, and how it streams (None: it does not)."""
    model, body, timeout_ms = _common(body, settings)
    openai_fields.check(body, openai_fields.COMPLETIONS)
    prompts = _strings(body, "prompt", settings, " (token ids are not supported)")
    params = generation_params(body, settings, default_max_tokens=16, scoring=scoring_params(body, chat=False))
    params = _constrained(params, body, chat=False)
    n = params.n
    if len(prompts) * n > settings.admission.max_inputs_per_call:
        raise InvalidInput(f"at most {settings.admission.max_inputs_per_call} prompts times 'n' per call")
    inputs = tuple(p for p in prompts for _ in range(n))  # choice index = prompt index * n + j, as OpenAI's
    call = Call(request_id=request_id, tenant=tenant, model=model, inputs=inputs, timeout_ms=timeout_ms,
                params=params)
    return call, streaming(body)


def parse_chat(body: Any, settings: Settings, request_id: str, tenant: str) -> tuple[Call, Streaming | None]:
    model, body, timeout_ms = _common(body, settings)
    openai_fields.check(body, openai_fields.CHAT)
    clean = chat_messages(body.get("messages"))
    params = generation_params(body, settings, default_max_tokens=min(256, settings.models.max_tokens_cap),
                               scoring=scoring_params(body, chat=True), chat=True)
    params = _constrained(params, body, chat=True)
    call = Call(request_id=request_id, tenant=tenant, model=model, inputs=(json.dumps(clean),) * params.n,
                timeout_ms=timeout_ms, params=params)
    return call, streaming(body)


def _constrained(params: SamplingParams, body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """The params with the grammar and tools of the body's ``response_format`` and ``tools``
    (:mod:`webapp.openai_tools`)."""
    grammar, tools = constraint(body, chat=chat)
    return replace(params, grammar=grammar, tools=tools) if grammar is not None or tools else params


# what /v1/embeddings takes (``user`` accepted, no behaviour here); anything else is a 400 naming it
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "user", "timeout_ms", "priority", "service_tier"})


def parse_embeddings(body: Any, settings: Settings, request_id: str, tenant: str) -> tuple[Call, str]:
    model, body, timeout_ms = _common(body, settings)
    if body.get("dimensions") is not None:
        raise InvalidInput("'dimensions' is not supported here: each model answers with its own embedding size")
    unknown = next((k for k in body if k not in EMBEDDING_FIELDS | {"dimensions"}), None)
    if unknown is not None:
        raise InvalidInput(f"unknown field '{unknown}': /v1/embeddings does not take it (docs/api.md lists the "
                           "fields it takes)")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidInput("'user' must be a string")
    inputs = _strings(body, "input", settings)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidInput("'encoding_format' must be 'float' or 'base64'")
    return Call(request_id=request_id, tenant=tenant, model=model, inputs=tuple(inputs),
                timeout_ms=timeout_ms), encoding


# -- responses -----------------------------------------------------------------------------------------
def usage(results: tuple[ItemResult, ...], choices: int = 1) -> dict[str, Any]:
    """Token counts as the workers reported them (OpenAI's ``usage``): each prompt's tokens once, however many
    ``choices`` it was asked for (its items are prompt-major: the first of each run of ``choices``), as OpenAI and
    vLLM count them; every choice's completion tokens. The ledger keeps each item's own counts. Of the prompt
    tokens, ``prompt_tokens_details.cached_tokens`` are those the workers' prefix caches held (always given:
    0 from a worker that keeps no cache, or says nothing of it)."""
    prompt = sum(int(r.output.get("prompt_tokens", 0)) for r in results[::choices])
    cached = sum(int(r.output.get("cached_tokens", 0)) for r in results[::choices])
    completion = sum(int(r.output.get("completion_tokens", 0)) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_response(request_id: str, model: str, results: tuple[ItemResult, ...],
                        created: int | None = None, choices: int = 1) -> dict[str, Any]:
    created = int(time.time()) if created is None else created
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": r.output.get("prompt", "") + r.output["text"],
                         "logprobs": completion_logprobs(r.output), "finish_reason": r.output["finish_reason"]}
                        for i, r in enumerate(results)],
            "usage": usage(results, choices)}


def chat_response(request_id: str, model: str, results: tuple[ItemResult, ...],
                  created: int | None = None, choices: int = 1, tools: bool = False) -> dict[str, Any]:
    """``tools``: the call's answers may hold tool calls (:func:`webapp.openai_tools.chat_choice`)."""
    created = int(time.time()) if created is None else created
    answers = [chat_choice(r.output, request_id, i, tools) for i, r in enumerate(results)]
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
            "model": model, "choices": [{"index": i, "logprobs": chat_logprobs(r.output), "finish_reason": reason,
                                         "message": message}
                                        for i, (r, (message, reason)) in enumerate(zip(results, answers, strict=True))],
            "usage": usage(results, choices)}


def completion_logprobs(output: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's legacy logprobs object of one completion choice (None unless asked for); with ``echo`` the
    prompt's tokens come first, as its text does."""
    if "logprobs" not in output:
        return None
    entries = [*output.get("prompt_logprobs", []), *output["logprobs"]]
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else dict(e["top"]) for e in entries], "text_offset": offsets}


def chat_logprobs(output: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of one chat choice: each token with its bytes and its likeliest alternatives."""
    if "logprobs" not in output:
        return None

    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [token(e["token"], e["logprob"]) | {"top_logprobs": [token(t, lp) for t, lp in e["top"] or []]}
                        for e in output["logprobs"]], "refusal": None}


class Named(Protocol):
    """What a chunk names: its call's request id and model (a :class:`Call`, or a call's record)."""

    @property
    def request_id(self) -> str: ...

    @property
    def model(self) -> str: ...


def chunk(call: Named, chat: bool, text: Any, finish_reason: str | None,
          streaming: Streaming | None = None, index: int = 0, output: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk of choice ``index``; for chat, ``text`` may be a whole delta object (the opening role
    chunk). ``output``: the choice's finished output, whose log-probabilities (if it asked for them) go in this,
    its last chunk. With ``include_usage`` each chunk carries ``usage: null``, as OpenAI's do."""
    if chat:
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        logprobs = None if output is None else chat_logprobs(output)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        logprobs = None if output is None else completion_logprobs(output)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out = _chunk_head(call, chat, streaming) | {"choices": [choice]}
    if streaming is not None and streaming.include_usage:
        out["usage"] = None
    return out


def usage_chunk(call: Named, chat: bool, results: tuple[ItemResult, ...], choices: int = 1,
                streaming: Streaming | None = None) -> dict[str, Any]:
    """The last chunk before ``[DONE]`` of a stream that asked for ``include_usage``: no choices, the counts
    (each prompt's once, whatever its ``choices``: :func:`usage`)."""
    return _chunk_head(call, chat, streaming) | {"choices": [], "usage": usage(results, choices)}


def _chunk_head(call: Named, chat: bool, streaming: Streaming | None = None) -> dict[str, Any]:
    if streaming is not None and streaming.tier:
        return _chunk_head(call, chat) | {"service_tier": streaming.tier}
    if chat:
        return {"id": f"chatcmpl-{call.request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": call.model}
    return {"id": f"cmpl-{call.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": call.model}


def embeddings_response(model: str, results: tuple[ItemResult, ...], encoding: str) -> dict[str, Any]:
    def encode(vector: list[float]) -> Any:
        if encoding == "base64":
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector

    tokens = sum(int(r.output.get("prompt_tokens", 0)) for r in results)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(r.output["embedding"])}
                     for i, r in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
