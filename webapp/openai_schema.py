"""OpenAI request parsing and response shapes, without I/O (the routes are in :mod:`webapp.openai_api`).

Only what this service can honour is accepted; anything else is a clear 400 rather than silently ignored
(``n`` > 1, token-id prompts, logprobs).
"""
from __future__ import annotations

import base64
import json
import struct
import time
from typing import Any

from tasks.config import Settings
from tasks.errors import InvalidInput
from tasks.gateway.calls import Call
from tasks.schema import ItemResult
from webapp.validation import check_model, timeout_limit_ms

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.manual_seed takes


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
    if body.get("n", 1) != 1:
        raise InvalidInput("only n=1 is supported")
    if body.get("logprobs") not in (None, False, 0):
        raise InvalidInput("logprobs are not supported")
    timeout_ms = _number(body, "timeout_ms", settings.admission.default_timeout_ms, 1, timeout_limit_ms(settings))
    return model, body, int(timeout_ms)


def generation_params(body: dict[str, Any], settings: Settings, *, default_max_tokens: int) -> dict[str, Any]:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    if max_tokens is None:
        max_tokens = default_max_tokens
    is_int = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
    if not is_int or not 1 <= max_tokens <= settings.models.max_tokens_cap:
        raise InvalidInput(f"'max_tokens' must be an integer from 1 to {settings.models.max_tokens_cap}")
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise InvalidInput("'stop' must be a string or a list of up to 4 non-empty strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX):
        raise InvalidInput(f"'seed' must be an integer from {SEED_MIN} to {SEED_MAX}")
    return {"max_tokens": max_tokens, "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 0.0, 1.0) or 1.0, "stop": stop or [], "seed": seed}


def _strings(body: dict[str, Any], name: str, settings: Settings, note: str = "") -> list[str]:
    """A field holding one string or a non-empty list of them (one batch item each)."""
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidInput(f"'{name}' must be a string or a non-empty list of strings{note}")
    if len(texts) > settings.admission.max_inputs_per_call:
        raise InvalidInput(f"at most {settings.admission.max_inputs_per_call} '{name}' entries per call")
    return texts


def parse_completion(body: Any, settings: Settings, request_id: str, tenant: str) -> tuple[Call, bool]:
    """A /v1/completions body -> the call to submit, and whether it streams."""
    model, body, timeout_ms = _common(body, settings)
    prompts = _strings(body, "prompt", settings, " (token ids are not supported)")
    params = generation_params(body, settings, default_max_tokens=16)
    call = Call(request_id=request_id, tenant=tenant, model=model, inputs=tuple(prompts), timeout_ms=timeout_ms,
                params=params)
    return call, bool(body.get("stream"))


def parse_chat(body: Any, settings: Settings, request_id: str, tenant: str) -> tuple[Call, bool]:
    model, body, timeout_ms = _common(body, settings)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer") \
                or not isinstance(m.get("content"), str):
            raise InvalidInput("each message needs a 'role' (system, user, assistant) and a string 'content'")
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    params = generation_params(body, settings, default_max_tokens=min(256, settings.models.max_tokens_cap))
    params["chat"] = True
    call = Call(request_id=request_id, tenant=tenant, model=model, inputs=(json.dumps(clean),),
                timeout_ms=timeout_ms, params=params)
    return call, bool(body.get("stream"))


def parse_embeddings(body: Any, settings: Settings, request_id: str, tenant: str) -> tuple[Call, str]:
    model, body, timeout_ms = _common(body, settings)
    inputs = _strings(body, "input", settings)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidInput("'encoding_format' must be 'float' or 'base64'")
    return Call(request_id=request_id, tenant=tenant, model=model, inputs=tuple(inputs),
                timeout_ms=timeout_ms), encoding


# -- responses -----------------------------------------------------------------------------------------
def _usage(results: tuple[ItemResult, ...]) -> dict[str, int]:
    prompt = sum(int(r.output.get("prompt_tokens", 0)) for r in results)
    completion = sum(int(r.output.get("completion_tokens", 0)) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(request_id: str, model: str, results: tuple[ItemResult, ...],
                        created: int | None = None) -> dict[str, Any]:
    created = int(time.time()) if created is None else created
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": r.output["text"], "logprobs": None,
                         "finish_reason": r.output["finish_reason"]} for i, r in enumerate(results)],
            "usage": _usage(results)}


def chat_response(request_id: str, model: str, results: tuple[ItemResult, ...],
                  created: int | None = None) -> dict[str, Any]:
    r = results[0]
    created = int(time.time()) if created is None else created
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
            "model": model, "choices": [{"index": 0, "logprobs": None, "finish_reason": r.output["finish_reason"],
                                         "message": {"role": "assistant", "content": r.output["text"]}}],
            "usage": _usage(results)}


def chunk(call: Call, chat: bool, text: Any, finish_reason: str | None) -> dict[str, Any]:
    """One streamed chunk; for chat, ``text`` may be a whole delta object (the opening role chunk)."""
    created = int(time.time())
    if chat:
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        return {"id": f"chatcmpl-{call.request_id}", "object": "chat.completion.chunk", "created": created,
                "model": call.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                  "finish_reason": finish_reason}]}
    return {"id": f"cmpl-{call.request_id}", "object": "text_completion", "created": created, "model": call.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


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
