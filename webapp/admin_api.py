"""Admin routes under /v1/admin: tenants, API keys and the autoscaling figures, for an admin key only.

The admin CLI (``llmb-admin``) does the same with direct database access; these routes are for automation
that should hold an admin key rather than database credentials.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from flask import Blueprint, Response, g, jsonify, request
from sqlalchemy.exc import SQLAlchemyError

from tasks.errors import InvalidInput, NotFound, Unavailable
from tasks.gateway.links import redis_call
from tasks.schema import json_integer
from tasks.state.model_load import model_report
from webapp import tenancy
from webapp.body import read_json
from webapp.errors import exception_response
from webapp.services import services

bp = Blueprint("admin", __name__, url_prefix="/v1/admin")


@bp.before_request
def _admin_only() -> None:
    g.admin = tenancy.admin()


@bp.errorhandler(SQLAlchemyError)
def _database_down(exc: SQLAlchemyError) -> Response:
    return exception_response(Unavailable(f"the database is unreachable: {type(exc).__name__}"))


@bp.errorhandler(ValueError)
def _bad_value(exc: ValueError) -> Response:
    return exception_response(InvalidInput(str(exc)))


def _json_object() -> dict[str, Any]:
    body = read_json(services().settings)
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    return body


@bp.get("/tenants")
def list_tenants() -> Response:
    s = services()
    tenants, now = s.keys.list_tenants(), s.clock()
    # Redis away: 503, as every route that reads it answers (not a 500)
    in_flight = redis_call(lambda: [s.admission.tenant_in_flight(p.name, now) for p in tenants])
    return jsonify(tenants=[{**asdict(p), "in_flight": n} for p, n in zip(tenants, in_flight)])


@bp.put("/tenants/<name>")
def set_tenant(name: str) -> Response:
    body = _json_object()
    unknown = set(body) - {"weight", "max_in_flight", "priority"}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    cap = json_integer(body.get("max_in_flight"))
    if cap is not None:
        body["max_in_flight"] = cap  # 5.0 is the integer 5, as JSON counts
    kinds = {"weight": ((int, float), "a number"), "max_in_flight": ((int,), "an integer"),
             "priority": ((str,), "a string")}
    for field, value in body.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds[field][0])):
            raise InvalidInput(f"'{field}' must be {kinds[field][1]}")
    return jsonify(asdict(services().keys.set_tenant(name, **body)))


@bp.get("/keys")
def list_keys() -> Response:
    keys = services().keys.list_keys(request.args.get("tenant"))
    return jsonify(keys=[{k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in asdict(info).items()}
                         for info in keys])


@bp.post("/keys")
def create_key() -> Response:
    body = _json_object()
    tenant, admin, label = body.get("tenant"), body.get("admin", False), body.get("label")
    if not isinstance(tenant, str):
        raise InvalidInput("'tenant' is required")
    if not isinstance(admin, bool):
        raise InvalidInput("'admin' must be true or false")
    if label is not None and not isinstance(label, str):
        raise InvalidInput("'label' must be a string")
    key_id, key = services().keys.create_key(tenant, admin=admin, label=label)
    response = jsonify(id=key_id, tenant=tenant, key=key, note="shown once: only its hash is stored")
    response.status_code = 201
    return response


@bp.delete("/keys/<key_id>")
def revoke_key(key_id: str) -> Response:
    if not services().keys.revoke(key_id):
        return exception_response(NotFound(f"no active key with id {key_id!r}"))
    return jsonify(id=key_id, revoked=True)


@bp.get("/stats")
def stats() -> Response:
    s = services()
    workers, now = s.gateway.live_workers(), s.clock()  # the fleet may come from cache: the report reads Redis
    return jsonify(models=redis_call(lambda: model_report(s.admission, workers, now,
                                                          s.settings.tenants.scale_headroom)))
