"""OpenAI-compatible endpoints, so the official `openai` client and the tools built on it work unchanged.

    POST /v1/completions   POST /v1/chat/completions   POST /v1/embeddings   GET /v1/models

Requests go through the same gateway as /v1/infer (admission, batching, deadlines); errors use OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from flask import Blueprint, Response, g, jsonify

from tasks.config import Settings
from tasks.errors import BatchingError, InvalidInput
from tasks.gateway.calls import Answer, Call
from tasks.gateway.gateway import Gateway
from tasks.policy.stream_position import Position
from tasks.schema import Priority
from tasks.state.records import Shape
from webapp import answers, openai_fields, sse, tenancy
from webapp.adapter_names import resolved, shown_model
from webapp.body import read_json
from webapp.errors import OPENAI, register_error_handlers
from webapp.openai_schema import Streaming, parse_chat, parse_completion, parse_embeddings
from webapp.openai_tools import calls_tools
from webapp.services import services
from webapp.validation import asks_offline

bp = Blueprint("openai", __name__)

T = TypeVar("T")
KIND_FOR = {"completions": ("causal",), "chat": ("causal",), "embeddings": ("embed",)}


register_error_handlers(bp, OPENAI)


def _parsed(parse: Callable[[Any, Settings, str, str], tuple[Call, T]]) -> tuple[Call, T]:
    """Parse the body (the caller was authenticated before it was read) and give the call its tenant's policy."""
    settings = services().settings
    body = read_json(settings)
    call, extra = parse(body, settings, g.request_id, g.claimed_tenant or "default")
    g.idempotency = answers.idempotency(body)
    call = resolved(tenancy.bind_caller(_with_priority(call, body), claimed_tenant=g.claimed_tenant))
    g.service_tier = openai_fields.served_tier(body, call.priority)  # echoed in the answer (Shape.tier)
    return call, extra


def _with_priority(call: Call, body: Any) -> Call:
    """The class the body asks for (:func:`webapp.validation.asks_offline`)."""
    return replace(call, priority=Priority.OFFLINE if asks_offline(body, openai=True) else Priority.INTERACTIVE)


def _run(call: Call, endpoint: str, shape: Shape) -> Answer:
    _check_model(call, endpoint)
    answer = answers.noted(services().gateway.submit(call, shape=shape, idempotency=g.get("idempotency")))
    g.batch_ids = list(dict.fromkeys(r.batch_id for r in answer.results))
    return answer


def _check_model(call: Call, endpoint: str) -> None:
    check_model(services().gateway, call, endpoint)


def check_model(gateway: Gateway, call: Call, endpoint: str) -> None:
    """The call's model (an adapter's base, once resolved) is served, and is of a kind ``endpoint`` serves; the
    refusals name the model as the caller did (an adapter by its name). A model known whose workers are all down
    (a restart's gap) goes on to the gateway's 503, which says to retry."""
    named = shown_model(call)
    kind = gateway.kind_of(call.model, named)
    if kind is not None and kind not in KIND_FOR[endpoint]:
        what = f"an adapter of {call.model!r}, " if named != call.model else ""
        raise InvalidInput(f"the model {named!r} is {what}a {kind} model; it cannot serve "
                           f"/v1/{'chat/completions' if endpoint == 'chat' else endpoint}")


def _sse(call: Call, endpoint: str, shape: Shape, streaming: Streaming) -> Response:
    """Server-sent events in OpenAI's chunk format, each chunk naming its choice's ``index`` (prompt-major, as
    OpenAI's: several prompts, ``n`` choices each). Refusals (429, 400...) happen before the stream starts, and
    so does any error before the worker's first token (a prompt too long for the model's context: 400
    context_length_exceeded, counted by the worker with the model's own tokenizer; a deadline passed in the
    queue: 504): the response starts with the first event. An idempotent retry of a finished stream gets each
    choice's whole text in one chunk. Every event but an error's carries an SSE ``id``: a client whose
    connection drops resumes the stream from it (:mod:`webapp.requests_api`)."""
    _check_model(call, endpoint)
    streaming = replace(streaming, tier=shape.tier)  # each chunk says the tier, as the answer does
    events = services().gateway.stream(call, shape=shape, idempotency=g.get("idempotency"))
    if events.replayed:
        g.request_id, g.replayed = events.request_id, True
        call = replace(call, request_id=events.request_id)
    chat = endpoint == "chat"
    stream = iter(events)
    try:
        first = next(stream, None)
    except BaseException:
        events.close()
        raise
    if isinstance(first, BatchingError):
        events.close()
        raise first

    named = replace(call, model=shown_model(call))  # each chunk names the adapter the caller named

    def generate() -> Iterator[str]:
        try:
            yield from sse.render(named, chat, streaming, openings(call, chat), shape.choices,
                                  itertools.chain([first] if first is not None else [], stream),
                                  Position.start(len(call.inputs)), on_error=_note_error, tools=shape.tool_calls)
        finally:
            events.close()  # the client went away mid-stream: cancel the generations (unless it resumes)

    return sse.response(generate())


def openings(call: Call, chat: bool) -> list[Any]:
    """What opens each choice of a stream: its role (chat), the prompt it echoes (a completion with echo), or
    nothing."""
    if chat:
        return [{"role": "assistant", "content": ""}] * len(call.inputs)
    return list(call.inputs) if call.params.echo else [None] * len(call.inputs)


def _note_error(error: BatchingError) -> None:
    g.error_type = error.type


@bp.post("/v1/completions")
@tenancy.authenticated
def completions() -> Response:
    call, stream = _parsed(parse_completion)
    shape = Shape("completions", stream=stream is not None, choices=call.params.n,
                  usage=stream is not None and stream.include_usage, echo=call.params.echo, tier=g.service_tier)
    if stream is not None:
        return _sse(call, "completions", shape, stream)
    return jsonify(answers.render(shape, shown_model(call), _run(call, "completions", shape)))


@bp.post("/v1/chat/completions")
@tenancy.authenticated
def chat_completions() -> Response:
    call, stream = _parsed(parse_chat)
    shape = Shape("chat", stream=stream is not None, choices=call.params.n,
                  usage=stream is not None and stream.include_usage, tier=g.service_tier,
                  tool_calls=calls_tools(call.params))
    if stream is not None:
        return _sse(call, "chat", shape, stream)
    return jsonify(answers.render(shape, shown_model(call), _run(call, "chat", shape)))


@bp.post("/v1/embeddings")
@tenancy.authenticated
def embeddings() -> Response:
    call, encoding = _parsed(parse_embeddings)
    shape = Shape("embeddings", encoding=encoding)
    return jsonify(answers.render(shape, shown_model(call), _run(call, "embeddings", shape)))


@bp.get("/v1/models")
@tenancy.authenticated
def models() -> Response:
    """The models served, then the LoRA adapters of them the caller's tenant may use, each with its ``parent``
    (its base model) and ``root`` (its directory), as vLLM lists them; another tenant's private ones are not.
    The fleet is read for the list, as /readyz reads it: the process's view may be half a heartbeat old, and a
    client that waited for readiness then listed the models missed a worker that had just joined."""
    s = services()
    served = {w.model for w in s.gateway.live_workers(fresh=True)}
    data: list[dict[str, Any]] = [{"id": m, "object": "model", "created": 0, "owned_by": "llm-batcher"}
                                  for m in sorted(served)]
    data += [{"id": a.name, "object": "model", "created": int(a.created_at.timestamp()),
              "owned_by": a.tenant or "llm-batcher", "parent": a.base_model, "root": a.path}
             for a in sorted(s.adapters.usable(tenancy.tenant_name()), key=lambda a: a.name)
             if a.base_model in served]
    return jsonify(object="list", data=data)

