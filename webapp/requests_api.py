"""``GET /v1/requests/<id>``: a call again, for the tenant that made it, within ``LLMB_RESULT_TTL_S`` of its end.

    {"id", "object": "request", "status": "running" | "completed" | "failed", "model", "route", "created",
     "items", "items_done", "response": {"status_code", "body"}}

``response`` (once finished) holds the status and the very body the call was answered with, in its route's
shape (a stream's: the non-streamed equivalent). Another tenant's id, an unknown one and an expired one are all
404: whether a call exists is its tenant's business.

The id is the request id (the caller's X-Request-Id, or the one generated for it), and a reused one names the
tenant's latest call with it. That is a convenience for reading a call again, nothing more: what an Idempotency-Key
answers is kept under the key (:mod:`tasks.state.requests`), so no reuse of an id changes it. A record this version
cannot read is a 409 ``record_unreadable`` (:class:`tasks.errors.RecordUnreadable`), not a 500.

``GET /v1/requests/<id>/stream``: a streamed chat or completion call's events again, after the one the
``Last-Event-ID`` header (or the ``last_event_id`` query parameter) names, for a client whose connection or API
process died mid-stream; without one, from the start. Any API process serves it (:mod:`tasks.gateway.resume`),
while the call runs and for ``LLMB_RESULT_TTL_S`` after; the events are those the first stream would have sent
next, ids included, then ``[DONE]``.
"""
from __future__ import annotations

from flask import Blueprint, Response, g, jsonify, request
from werkzeug.exceptions import NotFound

from tasks.policy.tenancy import check_tenant_name
from webapp import sse, tenancy
from webapp.answers import render
from webapp.errors import NATIVE, OPENAI, status_of
from webapp.openai_schema import Streaming
from webapp.services import services
from webapp.validation import REQUEST_ID

bp = Blueprint("requests", __name__)


def _tenant() -> str:
    """With keys, the key's tenant; without, the one X-Tenant names (the call's own, as it named it)."""
    return g.principal.tenant.name if g.principal is not None else check_tenant_name(g.claimed_tenant or "default")


def _not_found(request_id: str) -> NotFound:
    ttl_s = services().settings.stores.result_ttl_s
    return NotFound(f"no request {request_id!r} of this tenant within the last {ttl_s} "
                    "s (ids are kept as long as results are)")


@bp.get("/v1/requests/<request_id>")
@tenancy.authenticated
def get_request(request_id: str) -> Response:
    found = services().gateway.lookup(_tenant(), request_id) if REQUEST_ID.match(request_id) else None
    if found is None:
        raise _not_found(request_id)
    record = found.record
    body: dict[str, object] = {"id": record.request_id, "object": "request", "status": found.state.value,
                               "model": record.model, "route": record.shape.route,
                               "created": int(record.accepted_at), "items": len(record.items),
                               "items_done": found.present}
    if found.answer is not None:
        body["response"] = {"status_code": 200, "body": render(record.shape, record.model, found.answer)}
    elif found.error is not None:
        error, shape = found.error, NATIVE if record.shape.route == "infer" else OPENAI
        body["response"] = {"status_code": status_of(error.type), "body": shape.of(error, record.request_id)}
    return jsonify(body)


@bp.get("/v1/requests/<request_id>/stream")
@tenancy.authenticated
def resume_stream(request_id: str) -> Response:
    last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or None  # "": from the start
    resumed = services().gateway.resume(_tenant(), request_id, last) if REQUEST_ID.match(request_id) else None
    if resumed is None:
        raise _not_found(request_id)
    record = resumed.record
    chat = record.shape.route == "chat"
    openings = [{"role": "assistant", "content": ""} if chat else None] * len(record.items)
    events = sse.render(record, chat, Streaming(record.shape.usage, record.shape.tier), openings, record.shape.choices,
                        resumed.events, resumed.position, tools=record.shape.tool_calls)
    return sse.response(events)
