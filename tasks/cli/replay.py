"""`llmb-admin requeue` and `replay`: send requests stored in the ledger through the system again.

A replay is the same call as the first: the same tenant (with its weight and cap as they are now), model,
priority class and parameters (``max_tokens``, ``temperature``, ``seed``, chat or completion, the LoRA adapter),
which the ledger keeps for every request. Only the input itself is kept optionally (``LLMB_STORE_INPUTS=true``), so only
requests whose inputs were stored can be sent again.
"""
from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import click
from sqlalchemy import select

from tasks.cli.main import Admin, cli, fail, pass_admin, shown_url
from tasks.errors import BatchingError
from tasks.gateway.calls import Call
from tasks.gateway.gateway import Gateway
from tasks.policy.tenancy import TenantPolicy
from tasks.schema import NO_PARAMS, Priority, SamplingParams
from tasks.store.directory import TenantDirectory
from tasks.store.models import BatchRecord, BatchRequest, RequestRecord
from tasks.store.tenants import KeyStore


def replay_call(record: RequestRecord, policy: TenantPolicy, timeout_ms: int) -> Call:
    """The call that sends this ledger request again, as its caller first asked for it."""
    params = SamplingParams.from_dict(json.loads(record.params)) if record.params else NO_PARAMS
    priority = Priority(record.priority) if record.priority else Priority.INTERACTIVE
    return Call(request_id=f"replay-{record.id}", tenant=record.tenant, model=record.model,
                inputs=(record.input or "",), timeout_ms=timeout_ms, params=params, weight=policy.weight,
                priority=priority, tenant_cap=policy.max_in_flight)


class _Sender:
    """Sends ledger requests again through one gateway, each with its tenant's current policy."""

    def __init__(self, admin: Admin, timeout_ms: int) -> None:
        self.gateway = admin.gateway()
        self.tenants = TenantDirectory(KeyStore.from_settings(admin.settings),
                                       ttl_s=admin.settings.tenants.auth_cache_s)
        self.timeout_ms = timeout_ms

    def calls(self, records: list[RequestRecord]) -> list[Call]:
        return [replay_call(r, self.tenants.policy(r.tenant), self.timeout_ms) for r in records]

    def __call__(self, call: Call) -> tuple[str, Any]:
        return _submit(self.gateway, call)


def _submit(gateway: Gateway, call: Call) -> tuple[str, Any]:
    try:
        return "ok", gateway.submit(call).results[0].output
    except BatchingError as exc:
        return exc.type, exc.message


def _need_inputs(records: list[RequestRecord]) -> list[RequestRecord]:
    missing = [r.id for r in records if r.input is None]
    if missing:
        fail(f"{len(missing)} of these requests have no stored input (the ledger keeps inputs only with "
             "LLMB_STORE_INPUTS=true), e.g. " + ", ".join(missing[:3]))
    return records


@cli.command()
@click.argument("ident")
@click.option("--timeout-ms", default=30_000, show_default=True, type=click.IntRange(min=1))
@pass_admin
def requeue(admin: Admin, ident: str, timeout_ms: int) -> None:
    """Run a batch (all of its requests) or one request again, by id, and print the outcomes."""
    with admin.session() as session:
        record = session.get(RequestRecord, ident)
        if record is not None:
            records = [record]
        else:
            if session.get(BatchRecord, ident) is None:
                fail(f"no batch or request with id {ident!r} in the ledger at "
                     f"{shown_url(admin.settings.stores.database_url)}")
            records = list(session.scalars(select(RequestRecord).join(
                BatchRequest, BatchRequest.request_id == RequestRecord.id).where(BatchRequest.batch_id == ident)))
        _need_inputs(records)
    send = _Sender(admin, timeout_ms)
    calls = send.calls(records)
    with ThreadPoolExecutor(max_workers=min(len(records), 100) or 1) as pool:
        outcomes = list(pool.map(send, calls))
    for record, (status, detail) in zip(records, outcomes):
        click.echo(f"{record.id}  {status}  {json.dumps(detail)}")
    if any(status != "ok" for status, _ in outcomes):
        sys.exit(1)


def _parse_time(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO time such as 2026-11-29T10:00") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@cli.command()
@click.option("--status", help="Only requests with this final status (ok, poison, expired, exhausted, retrying).")
@click.option("--since", help="Accepted at or after this ISO time (UTC unless it says otherwise).")
@click.option("--until", help="Accepted before this ISO time.")
@click.option("--tenant", help="Only this tenant's requests.")
@click.option("--model", help="Only requests for this model (an adapter's call: its base model).")
@click.option("--adapter", help="Only requests that ran with this LoRA adapter (they run with it again).")
@click.option("--limit", default=10_000, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default=32, show_default=True, type=click.IntRange(1, 1000))
@click.option("--timeout-ms", default=30_000, show_default=True, type=click.IntRange(min=1))
@click.option("--dry-run", is_flag=True, help="Only say what would be sent.")
@pass_admin
def replay(admin: Admin, status: str | None, since: str | None, until: str | None, tenant: str | None,
           model: str | None, adapter: str | None, limit: int, concurrency: int, timeout_ms: int,
           dry_run: bool) -> None:
    """Send stored requests through the system again (their inputs must have been stored)."""
    query = select(RequestRecord).order_by(RequestRecord.accepted_at).limit(limit)
    for column, value in ((RequestRecord.status, status), (RequestRecord.tenant, tenant),
                          (RequestRecord.model, model), (RequestRecord.adapter, adapter)):
        if value:
            query = query.where(column == value)
    if (start := _parse_time(since)) is not None:
        query = query.where(RequestRecord.accepted_at >= start)
    if (end := _parse_time(until)) is not None:
        query = query.where(RequestRecord.accepted_at < end)
    with admin.session() as session:
        records = list(session.scalars(query))
    if not records:
        click.echo("no stored request matches")
        return
    _need_inputs(records)
    if dry_run:
        click.echo(f"would replay {len(records)} request(s), from {records[0].accepted_at} to "
                   f"{records[-1].accepted_at}")
        return
    send = _Sender(admin, timeout_ms)
    calls = send.calls(records)
    counts: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=concurrency) as pool, \
            click.progressbar(length=len(records), label="replaying", file=sys.stderr) as bar:
        for status_, _ in pool.map(send, calls):
            counts[status_] = counts.get(status_, 0) + 1
            bar.update(1)
    click.echo("replayed " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    if set(counts) - {"ok"}:
        sys.exit(1)
