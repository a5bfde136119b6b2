"""Request validation without I/O: a JSON body in, a :class:`tasks.gateway.Call` or InvalidInput out."""
from __future__ import annotations

import re
import uuid
from typing import Any

from tasks.config import Settings
from tasks.errors import InvalidInput
from tasks.gateway import Call

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def request_id_from(header: str | None) -> str:
    """The caller's X-Request-Id when it is well formed; otherwise a new one."""
    if header and REQUEST_ID.match(header):
        return header
    return uuid.uuid4().hex


def parse_infer(body: Any, settings: Settings, request_id: str, tenant_header: str | None = None) -> Call:
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object, e.g. {\"input\": \"hello\"}")
    unknown = set(body) - {"input", "inputs", "timeout_ms", "model", "tenant"}
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
        if len(raw) > settings.max_inputs_per_call:
            raise InvalidInput(f"'inputs' holds {len(raw)} items; the limit per call is {settings.max_inputs_per_call}")
        inputs = tuple(raw)

    timeout_ms = body.get("timeout_ms", settings.default_timeout_ms)
    is_number = isinstance(timeout_ms, (int, float)) and not isinstance(timeout_ms, bool)
    if not is_number or not 0 < timeout_ms <= settings.max_timeout_ms:
        raise InvalidInput(f"'timeout_ms' must be a number in (0, {settings.max_timeout_ms}]")

    model = body.get("model", settings.default_model)
    if not isinstance(model, str) or not model:
        raise InvalidInput("'model' must be a non-empty string")

    tenant = body.get("tenant", tenant_header or "default")
    if not isinstance(tenant, str) or not TENANT.match(tenant):
        raise InvalidInput("'tenant' must be 1-64 characters of letters, digits, '.', '_' or '-'")

    return Call(request_id=request_id, tenant=tenant, model=model, inputs=inputs, timeout_ms=int(timeout_ms))
