"""OpenAI-compatible endpoints, so the official `openai` client and the tools built on it work unchanged.

    POST /v1/completions   POST /v1/chat/completions   POST /v1/embeddings   GET /v1/models

Requests go through the same gateway as /v1/infer (admission, batching, deadlines); errors use OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from flask import Blueprint, Response, current_app, g, jsonify, request, stream_with_context
from werkzeug.exceptions import HTTPException

from tasks.broker.gateway import Call, Gateway
from tasks.config import Settings
from tasks.errors import BatchingError, InvalidInput
from tasks.schema import Priority
from webapp import tenancy
from webapp.body import read_json
from webapp.errors import openai_error_body
from webapp.openai_schema import (
    chat_response,
    chunk,
    completion_response,
    embeddings_response,
    parse_chat,
    parse_completion,
    parse_embeddings,
)
from webapp.validation import bind

bp = Blueprint("openai", __name__)

T = TypeVar("T")
KIND_FOR = {"completions": ("causal",), "chat": ("causal",), "embeddings": ("embed",)}


class ModelNotFound(BatchingError):
    """Raised when no live worker serves the model an OpenAI request names."""

    status = 404
    type = "model_not_found"


def openai_error(status: int, code: str, message: str, retry_after_s: int | None = None) -> Response:
    g.error_type = code
    response = jsonify(openai_error_body(status, code, message))
    response.status_code = status
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    return response


@bp.errorhandler(BatchingError)
def _batching_error(exc: BatchingError) -> Response:
    return openai_error(exc.status, exc.type, exc.message, exc.retry_after_s)


@bp.errorhandler(HTTPException)
def _http_error(exc: HTTPException) -> Response:
    status = exc.code or 500
    message = exc.description or exc.name
    if status == 413:
        message = f"request body larger than {current_app.config['MAX_CONTENT_LENGTH']} bytes"
    return openai_error(status, "invalid_request" if status == 400 else exc.name.lower().replace(" ", "_"),
                        message)


def _gateway() -> Gateway:
    return current_app.extensions["llmb"]  # type: ignore[no-any-return]


def _settings() -> Settings:
    return current_app.extensions["llmb_settings"]  # type: ignore[no-any-return]


def _tenant() -> str:
    return request.headers.get("X-Tenant") or "default"


def _parsed(parse: Callable[[Any, Settings, str, str], tuple[Call, T]]) -> tuple[Call, T]:
    """Authenticate (before the body is read), parse the body, and give the call its tenant's policy."""
    _authenticate()
    body = read_json(_settings())
    call, extra = parse(body, _settings(), g.request_id, _tenant())
    return _bind(call, body), extra


def _authenticate() -> None:
    """With keys, a missing or bad key is refused before the body is read."""
    if _settings().auth != "none":
        tenancy.caller()


def _bind(call: Call, body: Any) -> Call:
    """The caller's tenant policy on the call; ``service_tier: "flex"`` (or ``priority: "offline"``) asks for
    offline priority, as OpenAI's flex tier trades latency for price."""
    offline = isinstance(body, dict) and (body.get("service_tier") == "flex" or body.get("priority") == "offline")
    call = replace(call, priority=Priority.OFFLINE if offline else Priority.INTERACTIVE)
    settings = _settings()
    principal = tenancy.caller() if settings.auth != "none" else tenancy.caller(call.tenant)
    g.tenant = principal.tenant.name
    return bind(call, principal, settings, claimed_tenant=request.headers.get("X-Tenant"), received_at=g.started)


def _run(call: Call, endpoint: str) -> Any:
    _check_model(call, endpoint)
    answer = _gateway().submit(call)
    g.batch_ids = list(dict.fromkeys(r.batch_id for r in answer.results))
    return answer.results


def _check_model(call: Call, endpoint: str) -> None:
    kinds = {w.model: w.kind for w in _gateway().live_workers()}
    if call.model not in kinds:
        served = ", ".join(sorted(kinds)) or "none"
        raise ModelNotFound(f"the model {call.model!r} is not served here (models served now: {served})")
    if kinds[call.model] not in KIND_FOR[endpoint]:
        raise InvalidInput(f"the model {call.model!r} is a {kinds[call.model]} model; it cannot serve "
                           f"/v1/{'chat/completions' if endpoint == 'chat' else endpoint}")


def _sse(call: Call, endpoint: str) -> Response:
    """Server-sent events in OpenAI's chunk format; refusals (429, 400...) happen before the stream starts."""
    _check_model(call, endpoint)
    events = _gateway().stream(call)
    chat = endpoint == "chat"

    def generate() -> Iterator[str]:
        sent = ""
        try:
            if chat:
                yield _data(chunk(call, chat, {"role": "assistant", "content": ""}, None))
            for kind, value in events:
                if kind == "delta":
                    sent += value
                    yield _data(chunk(call, chat, value, None))
                elif kind == "done":
                    text = value.output["text"]
                    rest = text[len(sent):] if text.startswith(sent) else ""
                    yield _data(chunk(call, chat, rest, value.output["finish_reason"]))
                else:
                    g.error_type = value.type
                    yield _data(openai_error_body(value.status, value.type, value.message))
            yield "data: [DONE]\n\n"
        finally:
            events.close()  # the client went away mid-stream: cancel the generation in the worker

    return Response(stream_with_context(generate()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@bp.post("/v1/completions")
def completions() -> Response:
    call, stream = _parsed(parse_completion)
    if stream:
        return _sse(call, "completions")
    return jsonify(completion_response(call.request_id, call.model, _run(call, "completions")))


@bp.post("/v1/chat/completions")
def chat_completions() -> Response:
    call, stream = _parsed(parse_chat)
    if stream:
        return _sse(call, "chat")
    return jsonify(chat_response(call.request_id, call.model, _run(call, "chat")))


@bp.post("/v1/embeddings")
def embeddings() -> Response:
    call, encoding = _parsed(parse_embeddings)
    return jsonify(embeddings_response(call.model, _run(call, "embeddings"), encoding))


@bp.get("/v1/models")
def models() -> Response:
    _authenticate()
    served = sorted({w.model for w in _gateway().live_workers()})
    return jsonify(object="list", data=[{"id": m, "object": "model", "created": 0, "owned_by": "llm-batcher"}
                                        for m in served])

