"""vLLM's routes for LoRA adapters at run time, for an admin key: the same names and bodies, so tools written for
vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` register adapters here unchanged.

    POST /v1/load_lora_adapter     {"lora_name", "lora_path", "base_model"?, "tenant"?, "pinned"?}
    POST /v1/unload_lora_adapter   {"lora_name"}

``base_model``, ``tenant`` and ``pinned`` are ours: the model the adapter was trained on (by default the one
generation model the fleet serves, when it serves exactly one), the tenant that alone may call it (by default
every tenant may), and whether workers keep it loaded for good. Loading registers the adapter
(:class:`tasks.store.adapters.AdapterStore`); every API process serves it within ``LLMB_ADAPTER_CACHE_S``, and the
workers load its weights when a call first names it. ``llmb-admin adapters`` does the same from the command line.
"""
from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, g, jsonify
from sqlalchemy.exc import SQLAlchemyError

from tasks.errors import InvalidInput, NotFound, Unavailable
from webapp import tenancy
from webapp.body import read_json
from webapp.errors import OPENAI, exception_response, register_error_handlers
from webapp.openai_api import KIND_FOR
from webapp.services import services

bp = Blueprint("lora_adapters", __name__)
register_error_handlers(bp, OPENAI)
LOAD_FIELDS = {"lora_name", "lora_path", "base_model", "tenant", "pinned"}


@bp.before_request
def _admin_only() -> None:
    g.admin = tenancy.admin()


@bp.errorhandler(SQLAlchemyError)
def _database_down(exc: SQLAlchemyError) -> Response:
    return exception_response(Unavailable(f"the database is unreachable: {type(exc).__name__}"), OPENAI)


def _body(fields: set[str], required: tuple[str, ...]) -> dict[str, Any]:
    body = read_json(services().settings)
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    unknown = set(body) - fields
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    for name in required:
        if not isinstance(body.get(name), str) or not body[name]:
            raise InvalidInput(f"'{name}' is required (a string)")
    return body


def default_base(kinds: dict[str, str]) -> str:
    """The base model of an adapter loaded without one: the one generation model served, else a 400."""
    causal = sorted(m for m, kind in kinds.items() if kind in KIND_FOR["completions"])
    if len(causal) != 1:
        raise InvalidInput(f"give 'base_model': the fleet serves {len(causal) or 'no'} generation models"
                           + (f" ({', '.join(causal)})" if causal else ""))
    return causal[0]


@bp.post("/v1/load_lora_adapter")
def load_lora_adapter() -> Response:
    body = _body(LOAD_FIELDS, ("lora_name", "lora_path"))
    tenant, pinned, base = body.get("tenant"), body.get("pinned", False), body.get("base_model")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidInput("'tenant' must be a tenant's name, or null (every tenant may use the adapter)")
    if not isinstance(pinned, bool):
        raise InvalidInput("'pinned' must be true or false")
    s = services()
    kinds = {w.model: w.kind for w in s.gateway.live_workers()}
    if base is None:
        base = default_base(kinds)
    elif not isinstance(base, str):
        raise InvalidInput("'base_model' must be a model's name")
    adapter = s.adapter_store.add(body["lora_name"], base, body["lora_path"], tenant=tenant, pinned=pinned,
                                  served=set(kinds) | {s.settings.models.default_model})
    s.adapters.refresh()  # this process serves it at once; the others within LLMB_ADAPTER_CACHE_S
    return jsonify(message=f"Success: LoRA adapter '{adapter.name}' added successfully.", **adapter.as_dict())


@bp.post("/v1/unload_lora_adapter")
def unload_lora_adapter() -> Response:
    name = _body({"lora_name", "lora_int_id"}, ("lora_name",))["lora_name"]
    s = services()
    if not s.adapter_store.remove(name):
        raise NotFound(f"no LoRA adapter named {name!r} is registered")
    s.adapters.refresh()
    return jsonify(message=f"Success: LoRA adapter '{name}' removed successfully.", name=name)
