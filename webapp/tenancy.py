"""Who is calling: the API key in ``Authorization: Bearer``, or (with ``LLMB_AUTH=none``) a tenant by name.

The only module of the web app that knows about authentication; routes call :func:`caller` or
:func:`admin`, and the errors (401, 403) are rendered by the app's one error handler.
"""
from __future__ import annotations

from flask import current_app, request

from tasks.config import Settings
from tasks.errors import Forbidden, Unauthorized
from tasks.policy.tenancy import Principal, check_tenant_name
from tasks.store.tenants import HOW_TO_AUTH, TenantDirectory


def _directory() -> TenantDirectory:
    return current_app.extensions["llmb_tenants"]  # type: ignore[no-any-return]


def _settings() -> Settings:
    return current_app.extensions["llmb_settings"]  # type: ignore[no-any-return]


def bearer_key() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        return None
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized(f"the Authorization header must read 'Bearer <key>'; {HOW_TO_AUTH}")
    return key.strip()


def caller(named_tenant: str | None = None) -> Principal:
    """The caller of an inference route. Without auth, the tenant named by the request (or 'default')."""
    if _settings().auth == "none":
        name = check_tenant_name(named_tenant or request.headers.get("X-Tenant") or "default")
        return Principal(tenant=_directory().policy(name), key_id="", admin=False)
    return _directory().principal(bearer_key())


def admin() -> Principal:
    """The caller of an admin route: always an admin key, whatever LLMB_AUTH says."""
    principal = _directory().principal(bearer_key())
    if not principal.admin:
        raise Forbidden("this route needs an admin key (`llmb-admin keys create <tenant> --admin`)")
    return principal
