"""`llmb-admin jobs`: the Batch API's jobs (``/v1/batches``) for an operator: list, show, cancel.

A job's lines carry their request id (``<job>-<line>``), which is their correlation id in the ledger: ``jobs show
--lines`` lists each line with the batches that carried it.

What a tenant wrote (custom_id, metadata, the errors that quote its lines) is printed through :func:`shown`: a
control character or terminal escape in it is written as an escape sequence, never sent to the terminal.
"""
from __future__ import annotations

import json
import unicodedata
from datetime import UTC, datetime

import click
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from tasks.cli.main import Admin, cli, fail, first_line, pass_admin, shown_url
from tasks.store.jobs import FINAL, JobInfo, JobStore
from tasks.store.models import BatchRequest, RequestRecord, make_engine


def _store(admin: Admin) -> JobStore:
    return JobStore(make_engine(admin.settings.stores.database_url))


def _when(epoch: float | None) -> str:
    return "-" if epoch is None else datetime.fromtimestamp(epoch, tz=UTC).isoformat(timespec="seconds")


def shown(text: object) -> str:
    """``text`` safe to print to a terminal: control characters (ESC, CR, ...) and other invisible formatting
    characters as ``\\xNN`` / ``\\uNNNN`` escapes, everything else as it is."""
    return "".join(_escaped(c) for c in str(text))


def _escaped(c: str) -> str:
    if c == "\\":
        return "\\\\"  # so that an escape shown is never one the tenant typed
    if unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Zl", "Zp"):
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _database_error(admin: Admin, exc: SQLAlchemyError) -> None:
    where = shown_url(admin.settings.stores.database_url)
    fail(f"cannot read the jobs in the database at {where} ({first_line(exc)}); "
         "is it reachable, and upgraded (`llmb-admin db upgrade`)?")


@cli.group()
def jobs() -> None:
    """Batch jobs (/v1/batches): list, show, cancel."""


@jobs.command("list")
@click.option("--tenant", help="Only this tenant's jobs.")
@click.option("--status", help="Only jobs in this status (validating, in_progress, completed, ...).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--json", "as_json", is_flag=True)
@pass_admin
def jobs_list(admin: Admin, tenant: str | None, status: str | None, limit: int, as_json: bool) -> None:
    """Jobs, newest first: status, progress, who runs them."""
    try:
        found, more = _store(admin).page(tenant, limit=limit, status=status)
    except SQLAlchemyError as exc:
        _database_error(admin, exc)
        return
    if as_json:
        click.echo(json.dumps([j.to_dict() for j in found], indent=2))
        return
    if not found:
        click.echo("no batch job")
        return
    click.echo(f"{'ID':36} {'TENANT':16} {'STATUS':12} {'DONE':>13} {'FAILED':>7}  {'CREATED':25} RUN BY")
    for j in found:
        done = f"{j.completed + j.failed}/{j.total}"
        click.echo(f"{j.id:36} {shown(j.tenant):16} {j.status:12} {done:>13} {j.failed:>7}  "
                   f"{_when(j.created_at):25} {shown(j.lease_owner or '-')}")
    if more:
        click.echo(f"(more: --limit {limit * 2})")


@jobs.command("show")
@click.argument("job_id")
@click.option("--lines", "n_lines", default=0, type=click.IntRange(0, 100_000),
              help="Also list the first N lines with their status and the ledger's batches for each.")
@click.option("--json", "as_json", is_flag=True)
@pass_admin
def jobs_show(admin: Admin, job_id: str, n_lines: int, as_json: bool) -> None:
    """One job: its status, counts, files, lease; with --lines, its lines and the batches that ran them."""
    store = _store(admin)
    try:
        job = store.get(job_id)
        if job is None:
            fail(f"no batch job {job_id!r} in the database at {shown_url(admin.settings.stores.database_url)}")
        counts = store.counts(job_id)
        lines = store.lines(job_id, limit=n_lines) if n_lines else []
        batches = _batches(store, [r for _, _, r, _, _ in lines])
    except SQLAlchemyError as exc:
        _database_error(admin, exc)
        return
    rows = [{"line": n, "custom_id": c, "request_id": r, "status": s, "batches": batches.get(r, [])}
            for n, c, r, s, _ in lines]
    if as_json:
        click.echo(json.dumps({**job.to_dict(), "lines_by_status": counts, "lines": rows}, indent=2))
        return
    _print(job, counts)
    for row in rows:
        runs = ", ".join(row["batches"]) or "-"  # type: ignore[arg-type]
        click.echo(f"  line {row['line']:>6}  {row['status']:8} {shown(row['custom_id'])}  request "
                   f"{shown(row['request_id'])}  batches {shown(runs)}")


def _batches(store: JobStore, request_ids: list[str]) -> dict[str, list[str]]:
    """Ledger batches by line request id (every submission of a line is a request of the ledger)."""
    if not request_ids:
        return {}
    query = (select(RequestRecord.correlation_id, BatchRequest.batch_id)
             .join(BatchRequest, BatchRequest.request_id == RequestRecord.id)
             .where(RequestRecord.correlation_id.in_(request_ids)))
    found: dict[str, list[str]] = {}
    with store.engine.connect() as conn:
        for correlation_id, batch_id in conn.execute(query):
            found.setdefault(correlation_id, []).append(batch_id)
    return found


def _print(job: JobInfo, counts: dict[str, int]) -> None:
    click.echo(f"{job.id}  {job.status}  tenant {shown(job.tenant)}  {job.endpoint}")
    click.echo(f"  lines: {job.total} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items())) or 'none yet'}); "
               f"completed {job.completed}, failed {job.failed}")
    click.echo(f"  input {job.input_file_id}  output {job.output_file_id or '-'}  errors {job.error_file_id or '-'}")
    stamps = [(k, v) for k, v in (("created", job.created_at), ("in progress", job.in_progress_at),
                                  ("finalizing", job.finalizing_at), ("completed", job.completed_at),
                                  ("failed", job.failed_at), ("cancelling", job.cancelling_at),
                                  ("cancelled", job.cancelled_at), ("expired", job.expired_at),
                                  ("expires", job.expires_at)) if v is not None]
    click.echo("  " + "; ".join(f"{k} {_when(v)}" for k, v in stamps))
    if job.lease_owner:
        click.echo(f"  run by {shown(job.lease_owner)} (lease until {_when(job.lease_until)})")
    if job.metadata:
        click.echo(f"  metadata {shown(json.dumps(job.metadata, ensure_ascii=False))}")
    for error in job.errors or []:
        click.echo(f"  error: line {error.get('line')}: {shown(error.get('code'))}: {shown(error.get('message'))}")


@jobs.command("cancel")
@click.argument("job_id")
@pass_admin
def jobs_cancel(admin: Admin, job_id: str) -> None:
    """Stop a job: no more lines are sent, the running ones finish, then it is cancelled."""
    store = _store(admin)
    try:
        job = store.cancel(job_id, None, datetime.now(UTC).timestamp())
    except SQLAlchemyError as exc:
        _database_error(admin, exc)
        return
    if job is None:
        fail(f"no batch job {job_id!r}")
    if job.status in FINAL and job.status != "cancelled":
        fail(f"job {job_id} is {job.status}: nothing to cancel")
    click.echo(f"{job.id} {job.status}")
