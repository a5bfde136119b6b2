"""Request validation without I/O: a JSON body in, a :class:`tasks.gateway.calls.Call` or InvalidInput out."""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import replace
from typing import Any

from tasks.config import Settings
from tasks.errors import Forbidden, InvalidInput
from tasks.gateway.calls import Call
from tasks.policy.tenancy import Principal, check_tenant_name
from tasks.schema import Priority

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MODEL = re.compile(r"^[A-Za-z0-9._/-]{1,128}$")  # hub ids and folder names; no ':' (model names are in Redis keys)


def request_id_from(header: str | None) -> str:
    """The caller's X-Request-Id when it is well formed; otherwise a new one."""
    if header and REQUEST_ID.match(header):
        return header
    return uuid.uuid4().hex


def parse_infer(body: Any, settings: Settings, request_id: str, tenant_header: str | None = None) -> Call:
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object, e.g. {\"input\": \"hello\"}")
    unknown = set(body) - {"input", "inputs", "timeout_ms", "model", "tenant", "priority"}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    if ("input" in body) == ("inputs" in body):
        raise InvalidInput("give exactly one of 'input' (a string) or 'inputs' (a list of strings)")
    if "input" in body:
        if not isinstance(body["input"], str):
            raise InvalidInput("'input' must be a string")
        inputs: tuple[str, ...] = (body["input"],)
    else:
        raw = body["inputs"]
        if not isinstance(raw, list) or not raw or not all(isinstance(x, str) for x in raw):
            raise InvalidInput("'inputs' must be a non-empty list of strings")
        if len(raw) > settings.admission.max_inputs_per_call:
            raise InvalidInput(f"'inputs' holds {len(raw)} items; the limit per call is "
                               f"{settings.admission.max_inputs_per_call}")
        inputs = tuple(raw)

    timeout_ms = body.get("timeout_ms", settings.admission.default_timeout_ms)
    is_number = isinstance(timeout_ms, (int, float)) and not isinstance(timeout_ms, bool)
    if not is_number or not 0 < timeout_ms <= timeout_limit_ms(settings):
        raise InvalidInput(f"'timeout_ms' must be a number in (0, {settings.admission.max_timeout_ms}] "
                           f"({settings.admission.offline_max_timeout_ms} for offline requests)")

    model = body.get("model", settings.models.default_model)
    check_model(model)

    tenant = check_tenant_name(named_tenant(body, tenant_header))

    # rounded up, never past a limit: 300000.0001 ms is over 300000
    return Call(request_id=request_id, tenant=tenant, model=model, inputs=inputs, timeout_ms=math.ceil(timeout_ms),
                priority=parse_priority(body.get("priority")))


def named_tenant(body: dict[str, Any], tenant_header: str | None) -> Any:
    """The tenant a /v1/infer body names (without API keys): its ``"tenant"``, else X-Tenant, else "default"."""
    return body.get("tenant", tenant_header or "default")


def bearer_token(header: str) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (None: another scheme, or no key)."""
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def check_model(model: Any) -> str:
    if not isinstance(model, str) or not MODEL.match(model):
        raise InvalidInput("'model' must be 1-128 characters of letters, digits, '.', '_', '-' or '/' "
                           "(GET /v1/models lists the models served)")
    return model


def timeout_limit_ms(settings: Settings) -> int:
    """The largest timeout any request may give (offline ones may wait longer; :func:`bind` checks the rest)."""
    return max(settings.admission.max_timeout_ms, settings.admission.offline_max_timeout_ms)


def parse_priority(value: Any) -> Priority:
    if value is None:
        return Priority.INTERACTIVE
    if value not in (Priority.INTERACTIVE, Priority.OFFLINE):
        raise InvalidInput("'priority' must be 'interactive' (the default) or 'offline'")
    return Priority(value)


def asks_offline(body: Any, *, openai: bool) -> bool:
    """Whether a body asks for offline priority: ``"priority": "offline"``, or on the OpenAI routes also
    ``"service_tier": "flex"`` (OpenAI's flex tier trades latency for price)."""
    return isinstance(body, dict) and (body.get("priority") == Priority.OFFLINE
                                       or (openai and body.get("service_tier") == "flex"))


def priority_class(asked: Priority, tenant_class: Priority) -> Priority:
    """A call's class: offline when it asks for it or its tenant's class is offline (a tenant whose class is
    offline cannot ask to be interactive)."""
    return Priority.OFFLINE if Priority.OFFLINE in (asked, tenant_class) else Priority.INTERACTIVE


def bind(call: Call, principal: Principal, settings: Settings, *, claimed_tenant: str | None = None,
         received_at: float | None = None) -> Call:
    """Give a parsed call its tenant's weight, cap and priority class.

    With keys, the tenant is the key's: a call that names another tenant is refused. The request may ask to be
    offline; a tenant whose class is offline cannot ask to be interactive. Interactive calls keep the shorter
    timeout limit.
    """
    policy = principal.tenant
    if principal.key_id and claimed_tenant not in (None, policy.name):
        raise Forbidden(f"this API key belongs to tenant {policy.name!r}, not {claimed_tenant!r}; "
                        "leave the tenant out (the key says who you are)")
    priority = priority_class(call.priority, policy.priority)
    if priority == Priority.INTERACTIVE and call.timeout_ms > settings.admission.max_timeout_ms:
        limit_ms = settings.admission.max_timeout_ms
        raise InvalidInput(f"'timeout_ms' must be at most {limit_ms} for interactive requests; "
                           "longer deadlines need \"priority\": \"offline\"")
    return replace(call, tenant=policy.name, weight=policy.weight, priority=priority,
                   tenant_cap=policy.max_in_flight, received_at=received_at)
