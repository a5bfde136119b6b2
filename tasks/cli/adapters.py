"""`llmb-admin adapters`: LoRA adapters registered against a served base model (issue 44).

They live in the database (:class:`tasks.store.adapters.AdapterStore`), as POST /v1/load_lora_adapter registers
them too; API processes serve a change within LLMB_ADAPTER_CACHE_S, and workers load an adapter's weights from its
directory when a call first names it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import click
import redis
from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from tasks.cli.main import Admin, cli, fail, first_line, pass_admin, shown_url
from tasks.errors import BatchingError
from tasks.store.adapters import AdapterStore


@contextmanager
def _adapter_store(admin: Admin) -> Iterator[AdapterStore]:
    """The store, with database failures told as what to do about them (the URL's password masked)."""
    url = admin.settings.stores.database_url
    try:
        store = AdapterStore.from_settings(admin.settings)
    except SQLAlchemyError as exc:
        fail(f"invalid database URL {shown_url(url)!r}: {first_line(exc, url)}")
    try:
        yield store
    except BatchingError as exc:  # a bad name or directory, a name taken, the bound reached
        fail(exc.message)
    except SQLAlchemyError as exc:
        _explain(store, shown_url(url), exc, url)


def _explain(store: AdapterStore, shown: str, exc: SQLAlchemyError, url: str) -> NoReturn:
    try:
        tables = set(inspect(store.engine).get_table_names())
    except SQLAlchemyError:
        raise click.ClickException(f"cannot reach the database at {shown}: {type(exc).__name__}: "
                                   f"{first_line(exc, url)}") from None
    if "adapters" not in tables:
        raise click.ClickException(f"the database at {shown} has no adapters table yet: run `llmb-admin db upgrade`")
    raise click.ClickException(f"database error at {shown}: {type(exc).__name__}: {first_line(exc, url)}")


def _served(admin: Admin) -> set[str]:
    """The models the fleet serves now (an adapter may not take one's name), and the default model."""
    names = {admin.settings.models.default_model}
    try:
        return names | {w.model for w in admin.fleet().live(admin.clock()(), draining=True)}
    except redis.RedisError as exc:
        url = admin.settings.stores.redis_url
        click.echo(f"warning: cannot read the fleet from Redis at {shown_url(url)} ({first_line(exc, url)}): the "
                   "name is not checked against the models served", err=True)
        return names


@cli.group()
def adapters() -> None:
    """LoRA adapters: a call whose model names one runs on its base model with the adapter's weights."""


@adapters.command("add")
@click.argument("name")
@click.option("--base", "base_model", required=True, help="The served model the adapter was trained on.")
@click.option("--path", "path", required=True,
              help="The PEFT directory (adapter_config.json + adapter_model.safetensors), as the workers see it.")
@click.option("--tenant", help="The only tenant whose calls may use it (default: every tenant).")
@click.option("--pin", is_flag=True, help="Workers never evict it once loaded.")
@pass_admin
def adapters_add(admin: Admin, name: str, base_model: str, path: str, tenant: str | None, pin: bool) -> None:
    """Register the adapter NAME; API processes serve it within LLMB_ADAPTER_CACHE_S."""
    served = _served(admin)
    with _adapter_store(admin) as store:
        adapter = store.add(name, base_model, path, tenant=tenant, pinned=pin, served=served)
    click.echo(f"registered {adapter.name}: base {adapter.base_model}, rank {adapter.rank}, "
               f"{'tenant ' + adapter.tenant if adapter.tenant else 'every tenant'}"
               f"{', pinned' if adapter.pinned else ''}; served within {admin.settings.tenants.adapter_cache_s:g} s")


@adapters.command("list")
@click.option("--tenant", help="Only those this tenant may use (its own and the shared ones).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_admin
def adapters_list(admin: Admin, tenant: str | None, as_json: bool) -> None:
    """Registered adapters by name."""
    with _adapter_store(admin) as store:
        rows = store.list(tenant)
    if as_json:
        click.echo(json.dumps([a.as_dict() for a in rows], indent=2))
        return
    if not rows:
        click.echo("no adapter is registered (register one with `llmb-admin adapters add NAME --base MODEL "
                   "--path DIR`)")
        return
    click.echo(f"{'NAME':<32} {'BASE':<24} {'RANK':>4}  {'TENANT':<16} {'PINNED':<6} PATH")
    for a in rows:
        click.echo(f"{a.name:<32} {a.base_model:<24} {a.rank:>4}  {a.tenant or '(all)':<16} "
                   f"{'yes' if a.pinned else 'no':<6} {a.path}")


@adapters.command("remove")
@click.argument("name")
@pass_admin
def adapters_remove(admin: Admin, name: str) -> None:
    """Remove the adapter NAME; API processes stop serving it within LLMB_ADAPTER_CACHE_S."""
    with _adapter_store(admin) as store:
        removed = store.remove(name)
    if not removed:
        fail(f"no adapter named {name!r} (see `llmb-admin adapters list`)")
    click.echo(f"removed {name}; API processes stop serving it within {admin.settings.tenants.adapter_cache_s:g} s")
