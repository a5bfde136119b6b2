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
"""
from __future__ import annotations

from flask import Blueprint, Response, g, jsonify
from werkzeug.exceptions import NotFound

from tasks.policy.tenancy import check_tenant_name
from webapp import tenancy
from webapp.answers import render
from webapp.errors import NATIVE, OPENAI
from webapp.services import services
from webapp.validation import REQUEST_ID

bp = Blueprint("requests", __name__)


@bp.get("/v1/requests/<request_id>")
@tenancy.authenticated
def get_request(request_id: str) -> Response:
    # with keys, the key's tenant; without, the one X-Tenant names (the call's own, as it named it)
    tenant = g.principal.tenant.name if g.principal is not None else check_tenant_name(g.claimed_tenant or "default")
    found = services().gateway.lookup(tenant, request_id) if REQUEST_ID.match(request_id) else None
    if found is None:
        ttl_s = services().settings.stores.result_ttl_s
        raise NotFound(f"no request {request_id!r} of this tenant within the last {ttl_s} "
                       "s (ids are kept as long as results are)")
    record = found.record
    body: dict[str, object] = {"id": record.request_id, "object": "request", "status": found.state.value,
                               "model": record.model, "route": record.shape.route,
                               "created": int(record.accepted_at), "items": len(record.items),
                               "items_done": found.present}
    if found.answer is not None:
        body["response"] = {"status_code": 200, "body": render(record.shape, record.model, found.answer)}
    elif found.error is not None:
        error, shape = found.error, NATIVE if record.shape.route == "infer" else OPENAI
        body["response"] = {"status_code": error.status,
                            "body": shape.body(error.status, error.type, error.message, record.request_id)}
    return jsonify(body)
