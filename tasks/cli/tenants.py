"""`llmb-admin tenants` and `keys`: tenants' scheduling policy and the API keys that name them.

Both live in the database (:class:`tasks.store.tenants.KeyStore`); its errors are told as what to do about them.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click
from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from tasks.cli.main import Admin, cli, fail, first_line, pass_admin, shown_url
from tasks.policy.tenancy import TenantPolicy
from tasks.schema import Priority
from tasks.store.tenants import KeyInfo, KeyStore


@contextmanager
def _key_store(admin: Admin) -> Iterator[KeyStore]:
    """The store, with database failures told as what to do about them."""
    url = admin.settings.stores.database_url
    try:
        shown = shown_url(url)
        store = KeyStore.from_settings(admin.settings)
    except ValueError as exc:  # LLMB_TENANT_* defaults out of range
        fail(f"invalid tenant defaults: {exc}")
    except SQLAlchemyError as exc:
        fail(f"invalid database URL {shown_url(url)!r}: {first_line(exc, url)}")
    try:
        yield store
    except SQLAlchemyError as exc:
        _explain_database_error(store, shown, exc)


def _explain_database_error(store: KeyStore, shown: str, exc: SQLAlchemyError) -> NoReturn:
    try:
        tables = set(inspect(store.engine).get_table_names())
    except SQLAlchemyError:
        raise click.ClickException(f"cannot reach the database at {shown}: {type(exc).__name__}: "
                                   f"{first_line(exc)}") from None
    if not {"tenants", "api_keys"} <= tables:
        raise click.ClickException(f"the database at {shown} has no tenant tables yet: run `llmb-admin db upgrade`")
    raise click.ClickException(f"database error at {shown}: {type(exc).__name__}: {first_line(exc)}")


def _policy_dict(p: TenantPolicy) -> dict[str, Any]:
    return {"name": p.name, "weight": p.weight, "max_in_flight": p.max_in_flight, "priority": p.priority.value}


def _key_dict(k: KeyInfo) -> dict[str, Any]:
    return {"id": k.id, "tenant": k.tenant, "admin": k.admin, "label": k.label,
            "created_at": k.created_at.isoformat(), "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}


# -- tenants --------------------------------------------------------------------------------------------
@cli.group()
def tenants() -> None:
    """Tenants' weights, in-flight caps and priority classes (defaults: LLMB_TENANT_*)."""


@tenants.command("set")
@click.argument("name")
@click.option("--weight", type=click.FloatRange(min=0, min_open=True, max=1000),
              help="Share of batch slots when tenants compete (default: LLMB_TENANT_WEIGHT).")
@click.option("--max-in-flight", type=click.IntRange(min=1),
              help="Items admitted and not yet answered; over it: 429 (default: LLMB_TENANT_MAX_IN_FLIGHT).")
@click.option("--priority", type=click.Choice([p.value for p in Priority]),
              help="Priority class (default: LLMB_TENANT_PRIORITY).")
@pass_admin
def tenants_set(admin: Admin, name: str, weight: float | None, max_in_flight: int | None,
                priority: str | None) -> None:
    """Create or change a tenant's settings; what is not given stays as it was."""
    with _key_store(admin) as store:
        try:
            policy = store.set_tenant(name, weight=weight, max_in_flight=max_in_flight, priority=priority)
        except ValueError as exc:
            fail(str(exc))
    click.echo(f"{policy.name}  weight={policy.weight:g}  max_in_flight={policy.max_in_flight}  "
               f"priority={policy.priority.value}")


@tenants.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_admin
def tenants_list(admin: Admin, as_json: bool) -> None:
    """Every tenant with settings or a key, with its effective policy."""
    with _key_store(admin) as store:
        rows = store.list_tenants()
    if as_json:
        click.echo(json.dumps([_policy_dict(p) for p in rows], indent=2))
        return
    d = store.defaults
    if not rows:
        click.echo(f"no tenant has settings or keys; every tenant gets the defaults: weight={d.weight:g}, "
                   f"max_in_flight={d.max_in_flight}, priority={d.priority.value}")
        return
    click.echo(f"{'TENANT':<32} {'WEIGHT':>8} {'MAX IN FLIGHT':>13}  PRIORITY")
    for p in rows:
        click.echo(f"{p.name:<32} {p.weight:>8g} {p.max_in_flight:>13}  {p.priority.value}")


# -- API keys -------------------------------------------------------------------------------------------
@cli.group()
def keys() -> None:
    """API keys: `Authorization: Bearer <key>` names the tenant (the database keeps only their SHA-256)."""


@keys.command("create")
@click.argument("tenant")
@click.option("--admin", "is_admin", is_flag=True, help="The key may also use admin operations.")
@click.option("--label", help="A note to tell keys apart (who holds it, what for).")
@pass_admin
def keys_create(admin: Admin, tenant: str, is_admin: bool, label: str | None) -> None:
    """Issue a key for TENANT and print it, alone, on stdout: it is shown this once and never again."""
    with _key_store(admin) as store:
        try:
            key_id, key = store.create_key(tenant, admin=is_admin, label=label)
        except ValueError as exc:
            fail(str(exc))
    click.echo(key)
    click.echo(f"created {'admin ' if is_admin else ''}key {key_id} for tenant {tenant}: it is shown only once, "
               f"store it now (revoke it with `llmb-admin keys revoke {key_id}`)", err=True)


@keys.command("list")
@click.option("--tenant", help="Only this tenant's keys.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_admin
def keys_list(admin: Admin, tenant: str | None, as_json: bool) -> None:
    """Issued keys by id (never the keys themselves), revoked ones included."""
    with _key_store(admin) as store:
        rows = store.list_keys(tenant)
    if as_json:
        click.echo(json.dumps([_key_dict(k) for k in rows], indent=2))
        return
    if not rows:
        click.echo("no key has been issued" + (f" for {tenant}" if tenant else "") +
                   " (issue one with `llmb-admin keys create <tenant>`)")
        return
    click.echo(f"{'ID':<10} {'TENANT':<24} {'ADMIN':<5} {'CREATED':<20} {'REVOKED':<20} LABEL")
    for k in rows:
        revoked = k.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if k.revoked_at else "-"
        click.echo(f"{k.id:<10} {k.tenant:<24} {'yes' if k.admin else 'no':<5} "
                   f"{k.created_at.strftime('%Y-%m-%d %H:%M:%S'):<20} {revoked:<20} {k.label or ''}")


@keys.command("revoke")
@click.argument("key_id")
@pass_admin
def keys_revoke(admin: Admin, key_id: str) -> None:
    """Revoke a key by id; API processes stop accepting it within LLMB_AUTH_CACHE_S."""
    with _key_store(admin) as store:
        revoked = store.revoke(key_id)
    if not revoked:
        fail(f"no active key with id {key_id!r}: unknown or already revoked (see `llmb-admin keys list`)")
    click.echo(f"revoked {key_id}; API processes refuse it within {admin.settings.tenants.auth_cache_s:g} s")
