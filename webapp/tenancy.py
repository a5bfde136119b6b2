"""Who is calling: the API key in ``Authorization: Bearer``, or (with ``LLMB_AUTH=none``) a tenant by name.

The only module of the web app that knows about authentication. Every inference route is wrapped in
:func:`authenticated` and gives its parsed call to :func:`bind_caller`; admin routes call :func:`admin`. The
errors (401, 403) are rendered by the app's one error responder.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import wraps
from typing import ParamSpec, TypeVar

from flask import g, request

from tasks.errors import Forbidden, Unauthorized
from tasks.gateway.calls import Call
from tasks.policy.tenancy import Principal, check_tenant_name
from tasks.store.tenants import HOW_TO_AUTH
from webapp.services import services
from webapp.validation import bearer_token, bind

P = ParamSpec("P")
R = TypeVar("R")


def bearer_key() -> str | None:
    header = request.headers.get("Authorization", "")
    if not header:
        return None
    key = bearer_token(header)
    if key is None:
        raise Unauthorized(f"the Authorization header must read 'Bearer <key>'; {HOW_TO_AUTH}")
    return key


def authenticated(view: Callable[P, R]) -> Callable[P, R]:
    """The one authentication step of an inference route, before its body is read (a bad key costs no read).

    Sets ``g.claimed_tenant`` (the X-Tenant header, read here only) and ``g.principal``: with keys the key's
    principal (401 when missing, unknown or revoked); without keys None, as the tenant is the one the request
    names, known once its body is parsed (:func:`bind_caller` looks it up then).
    """

    @wraps(view)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        g.claimed_tenant = request.headers.get("X-Tenant")
        s = services()
        g.principal = None if s.settings.tenants.auth == "none" else s.tenants.principal(bearer_key())
        return view(*args, **kwargs)

    return checked


def bind_caller(call: Call, claimed_tenant: str | None) -> Call:
    """``call`` with its caller's tenant policy (see :func:`webapp.validation.bind`; 403 when a key's call claims
    another tenant). Without keys the caller is the tenant ``call`` names, looked up here, once."""
    principal: Principal | None = g.principal
    if principal is None:
        principal = g.principal = Principal(tenant=services().tenants.policy(call.tenant), key_id="", admin=False)
    bound = bind(call, principal, services().settings, claimed_tenant=claimed_tenant, received_at=g.started)
    trace = g.get("trace")  # its llmb.call span (tracing on): the gateway's, batcher's and worker's spans nest in it
    return bound if trace is None else replace(bound, trace=trace)


def admin() -> Principal:
    """The caller of an admin route: always an admin key, whatever LLMB_AUTH says."""
    principal = services().tenants.principal(bearer_key())
    if not principal.admin:
        raise Forbidden("this route needs an admin key (`llmb-admin keys create <tenant> --admin`)")
    return principal


def tenant_name() -> str:
    """The caller's tenant, before its body names one: its key's, or (without keys) the X-Tenant header's,
    ``default`` if none (a call without keys names its tenant the same way)."""
    principal = g.get("principal")
    if principal is not None:
        return str(principal.tenant.name)
    return check_tenant_name(g.get("claimed_tenant") or "default")
