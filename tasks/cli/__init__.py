"""`llmb-admin`: the operator's command line (fleet, stats, requeue, replay, quarantine, database).

Connection settings come from the same ``LLMB_*`` variables as every process, or from the group's options.
"""
from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import click
import redis
from sqlalchemy import inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from tasks.broker.gateway import Call, Gateway
from tasks.broker.queues import RequestPublisher
from tasks.config import Settings
from tasks.errors import BatchingError
from tasks.policy.tenancy import TenantPolicy
from tasks.schema import Priority
from tasks.state.admission import Admission, model_report
from tasks.state.fleet import Fleet
from tasks.state.quarantine import Quarantine
from tasks.store.ledger import BatchRecord, BatchRequest, Ledger, RequestRecord, make_engine
from tasks.store.tenants import KeyInfo, KeyStore

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


class Admin:
    """What the commands share: settings and lazily opened connections."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._redis: redis.Redis | None = None

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        return self._redis

    def fleet(self) -> Fleet:
        s = self.settings
        return Fleet(self.redis, s.key("fleet"), s.heartbeat_stale_s)

    def session(self) -> Session:
        return Session(make_engine(self.settings.database_url))

    def gateway(self) -> Gateway:
        s = self.settings
        return Gateway(s, self.redis, RequestPublisher(s.broker_url, s.request_queue, 4), f"cli-{uuid.uuid4().hex}")


pass_admin = click.make_pass_decorator(Admin)


def fail(message: str) -> None:
    raise click.ClickException(message)


@click.group()
@click.option("--namespace", envvar="LLMB_NAMESPACE", help="Queue and key prefix [LLMB_NAMESPACE].")
@click.option("--redis-url", envvar="LLMB_REDIS_URL", help="[LLMB_REDIS_URL]")
@click.option("--broker-url", envvar="LLMB_BROKER_URL", help="[LLMB_BROKER_URL]")
@click.option("--database-url", envvar="LLMB_DATABASE_URL", help="[LLMB_DATABASE_URL]")
@click.pass_context
def cli(ctx: click.Context, **options: str | None) -> None:
    """Operate an llm-batcher system: its fleet, its queues, its ledger."""
    ctx.obj = Admin(Settings.from_env(overrides={k: v for k, v in options.items() if v}))


# -- fleet and stats ------------------------------------------------------------------------------------
@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_admin
def workers(admin: Admin, as_json: bool) -> None:
    """The fleet, from heartbeats: state, backlog and speed of every GPU worker."""
    try:
        fleet = admin.fleet()
        now = time.time()
        rows = sorted(fleet.all(), key=lambda w: w.id)
    except redis.RedisError as exc:
        fail(f"cannot reach Redis at {admin.settings.redis_url}: {exc}")
    if as_json:
        click.echo(json.dumps([{**w.__dict__, "live": now - w.heartbeat_at <= fleet.stale_after_s}
                               for w in rows], indent=2))
        return
    if not rows:
        click.echo("no GPU worker has sent a heartbeat (start one with `gpu-worker --gpu 0`)")
        return
    click.echo(f"{'WORKER':<28} {'MODEL':<16} {'STATE':<6} {'QUEUED':>6} {'FREE IN':>9} {'BATCH':>9} "
               f"{'DONE':>7} {'TOK/S':>8} {'UTIL':>5} {'SEEN':>6}  QUEUE")
    for w in rows:
        age = now - w.heartbeat_at
        state = w.state if age <= fleet.stale_after_s else "STALE"
        click.echo(f"{w.id:<28} {w.model:<16} {state:<6} {w.outstanding:>6} {w.free_in_ms:>7.0f}ms "
                   f"{w.batch_ms_estimate:>7.0f}ms {w.completed:>7} {w.tokens_per_s:>8.1f} {w.utilisation:>5.0%} "
                   f"{age:>5.1f}s  {w.queue}")


@cli.command()
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between the two samples that rates are computed from.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_admin
def stats(admin: Admin, interval: float, as_json: bool) -> None:
    """Queue depth, age of the oldest waiting request, batches per second and how full they are; per model, the
    autoscaling signal (oldest queued request, arrival rate, recommended workers)."""
    s = admin.settings
    keys = [s.key("stats", "items_done"), s.key("stats", "batches_done"), s.key("stats", "ledger_dropped"),
            s.key("stats", "tokens")]
    run_key = s.key("metrics", "batch_run_seconds")
    try:
        before = [int(v or 0) for v in admin.redis.mget(keys)]
        busy_before = float(admin.redis.hget(run_key, "sum") or 0)
        time.sleep(interval)
        after = [int(v or 0) for v in admin.redis.mget(keys)]
        busy_after = float(admin.redis.hget(run_key, "sum") or 0)
        now = time.time()
        admission = Admission(admin.redis, s.key("inflight"), s.admission_cap, s.key("quarantine"))
        in_flight = admission.in_flight(now)
        oldest = admission.oldest_arrival()
        quarantined = int(admin.redis.scard(s.key("quarantine")))
        live_workers = admin.fleet().live(now)
        live = len(live_workers)
        models = model_report(admission, live_workers, now, s.scale_headroom)
    except redis.RedisError as exc:
        fail(f"cannot reach Redis at {s.redis_url}: {exc}")
    try:
        publisher = RequestPublisher(s.broker_url, s.request_queue, 1)
        with publisher.pool.acquire(block=True, timeout=5) as conn:
            _, queued, _ = conn.default_channel.queue_declare(s.request_queue, passive=True)
    except Exception as exc:
        queued = None
        click.echo(f"warning: cannot read the request queue from RabbitMQ: {exc}", err=True)
    items, batches, tokens = after[0] - before[0], after[1] - before[1], after[3] - before[3]
    tokens_per_s = tokens / interval
    devices_cost_per_s = s.device_price_per_hour * live / 3600
    report: dict[str, Any] = {
        "queue_depth": queued,
        "in_flight": in_flight,
        "oldest_waiting_s": round(now - oldest, 3) if oldest is not None else 0.0,
        "batches_per_s": round(batches / interval, 2),
        "items_per_s": round(items / interval, 2),
        "fill_ratio": round(items / (batches * s.max_batch_size), 3) if batches else None,
        "live_workers": live,
        "tokens_per_s": round(tokens_per_s, 1),
        "device_busy_fraction": round((busy_after - busy_before) / (interval * live), 3) if live else None,
        "cost_per_million_tokens": round(devices_cost_per_s / tokens_per_s * 1e6, 4) if tokens_per_s else None,
        "quarantined_inputs": quarantined,
        "ledger_records_dropped": after[2],
    }
    if as_json:
        click.echo(json.dumps({**report, "models": models}, indent=2))
        return
    for key, value in report.items():
        click.echo(f"{key.replace('_', ' '):<24} {'-' if value is None else value}")
    if models:
        click.echo(f"\n{'MODEL':<24} {'WORKERS':>7} {'OLDEST':>8} {'ITEMS/S':>8} {'BATCH':>8} {'RECOMMENDED':>11}")
    for m in models:
        batch = "-" if m["batch_ms"] is None else f"{m['batch_ms']:.0f}ms"
        rec = "-" if m["recommended_workers"] is None else m["recommended_workers"]
        click.echo(f"{m['model']:<24} {m['workers']:>7} {m['oldest_queued_s']:>7.2f}s {m['arrival_rate_per_s']:>8.1f} "
                   f"{batch:>8} {rec:>11}")


# -- running stored requests again ----------------------------------------------------------------------
def _submit(gateway: Gateway, record: RequestRecord, timeout_ms: int) -> tuple[str, Any]:
    call = Call(request_id=f"replay-{record.id}", tenant=record.tenant, model=record.model,
                inputs=(record.input or "",), timeout_ms=timeout_ms)
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
                fail(f"no batch or request with id {ident!r} in the ledger at {admin.settings.database_url}")
            records = list(session.scalars(select(RequestRecord).join(
                BatchRequest, BatchRequest.request_id == RequestRecord.id).where(BatchRequest.batch_id == ident)))
        _need_inputs(records)
    gateway = admin.gateway()
    with ThreadPoolExecutor(max_workers=min(len(records), 100) or 1) as pool:
        outcomes = list(pool.map(lambda r: _submit(gateway, r, timeout_ms), records))
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
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


@cli.command()
@click.option("--status", help="Only requests with this final status (ok, poison, expired, exhausted, retrying).")
@click.option("--since", help="Accepted at or after this ISO time (UTC unless it says otherwise).")
@click.option("--until", help="Accepted before this ISO time.")
@click.option("--tenant", help="Only this tenant's requests.")
@click.option("--model", help="Only requests for this model.")
@click.option("--limit", default=10_000, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default=32, show_default=True, type=click.IntRange(1, 1000))
@click.option("--timeout-ms", default=30_000, show_default=True, type=click.IntRange(min=1))
@click.option("--dry-run", is_flag=True, help="Only say what would be sent.")
@pass_admin
def replay(admin: Admin, status: str | None, since: str | None, until: str | None, tenant: str | None,
           model: str | None, limit: int, concurrency: int, timeout_ms: int, dry_run: bool) -> None:
    """Send stored requests through the system again (their inputs must have been stored)."""
    query = select(RequestRecord).order_by(RequestRecord.accepted_at).limit(limit)
    for column, value in ((RequestRecord.status, status), (RequestRecord.tenant, tenant),
                          (RequestRecord.model, model)):
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
    gateway = admin.gateway()
    counts: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=concurrency) as pool, \
            click.progressbar(length=len(records), label="replaying", file=sys.stderr) as bar:
        for status_, _ in pool.map(lambda r: _submit(gateway, r, timeout_ms), records):
            counts[status_] = counts.get(status_, 0) + 1
            bar.update(1)
    click.echo("replayed " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    if set(counts) - {"ok"}:
        sys.exit(1)


# -- quarantine -----------------------------------------------------------------------------------------
@cli.group()
def quarantine() -> None:
    """Inputs that failed alone and are refused until released."""


def _shown(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL at all: the error about it says so
        return url


@quarantine.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_admin
def quarantine_list(admin: Admin, as_json: bool) -> None:
    """Every quarantined input: hash, model, when, why.

    Read from the ledger (the durable record) and from Redis (what the door enforces), so that the list is
    whole when either is away or Redis has restarted and lost its copy; ``enforced`` says which are refused
    right now.
    """
    s = admin.settings
    q = Quarantine(admin.redis, s.key("quarantine"))
    problems: list[str] = []
    durable: list[dict[str, Any]] = []
    live: list[dict[str, Any]] = []
    enforced: set[str] | None = None
    try:
        durable = Ledger(make_engine(s.database_url)).quarantined()
    except SQLAlchemyError as exc:
        problems.append(f"cannot read the ledger at {_shown(s.database_url)}: {_first_line(exc)}")
    try:
        live, enforced = q.list(), q.members()
    except redis.RedisError as exc:
        problems.append(f"cannot reach Redis at {s.redis_url}: {exc}")
    if len(problems) == 2:
        fail("; ".join(problems))
    for problem in problems:
        click.echo(f"warning: {problem}; listing what the other one holds", err=True)
    merged: dict[str, dict[str, Any]] = {}
    for e in [*durable, *live]:  # Redis's details win: they are what is enforced
        merged[e["hash"]] = {**merged.get(e["hash"], {}), **e}
    entries = sorted(({**e, "enforced": None if enforced is None else e["hash"] in enforced}
                      for e in merged.values()), key=lambda e: e["since"])
    if as_json:
        click.echo(json.dumps(entries, indent=2))
        return
    if not entries:
        click.echo("no input is quarantined")
    for e in entries:
        since = datetime.fromtimestamp(e["since"], tz=timezone.utc).isoformat(timespec="seconds")
        note = ("" if e["enforced"] is not False else
                "  NOT ENFORCED: Redis lost it (a batcher restores it from the ledger within a second)")
        click.echo(f"{e['hash']}  {e['model']}  {since}  batch {e['batch_id']}  request {e['request_id']}{note}\n"
                   f"    {e['reason']}")


@quarantine.command("release")
@click.argument("digest")
@pass_admin
def quarantine_release(admin: Admin, digest: str) -> None:
    """Accept this input again.

    The ledger is marked first, so that a batcher restoring the quarantine into a restarted Redis cannot
    bring the input back; then Redis stops refusing it.
    """
    s = admin.settings
    in_ledger: bool | None = None
    try:
        in_ledger = Ledger(make_engine(s.database_url)).release(digest)
    except SQLAlchemyError as exc:
        click.echo(f"warning: cannot record the release in the ledger at {_shown(s.database_url)} "
                   f"({_first_line(exc)}): the input is accepted again now, but a restarted Redis would refuse "
                   "it again; run this command once more when the database is reachable", err=True)
    try:
        in_redis = Quarantine(admin.redis, s.key("quarantine")).release(digest)
    except redis.RedisError as exc:
        recorded = " (the ledger records it as released; run this again to release it in Redis)" if in_ledger else ""
        fail(f"cannot reach Redis at {s.redis_url}: {exc}{recorded}")
    if not in_redis and in_ledger is None:
        fail(f"{digest} is not quarantined in Redis, and the ledger, which may still hold it, cannot be reached: "
             "run this again when the database is reachable")
    if not in_redis and not in_ledger:
        fail(f"{digest} is not quarantined (see `llmb-admin quarantine list`)")
    click.echo(f"released {digest}")


# -- database -------------------------------------------------------------------------------------------
@cli.group()
def db() -> None:
    """The ledger's schema (Alembic migrations)."""


def _alembic(admin: Admin) -> Any:
    from alembic.config import Config

    config = Config(str(MIGRATIONS / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", admin.settings.database_url.replace("%", "%%"))
    return config


@db.command()
@click.option("--revision", default="head", show_default=True)
@pass_admin
def upgrade(admin: Admin, revision: str) -> None:
    """Create or upgrade the ledger's tables."""
    from alembic import command

    command.upgrade(_alembic(admin), revision)
    click.echo(f"database at {admin.settings.database_url} is at {revision}")


@db.command()
@click.argument("revision")
@pass_admin
def downgrade(admin: Admin, revision: str) -> None:
    """Go back to an older schema revision ("base" removes every table)."""
    from alembic import command

    command.downgrade(_alembic(admin), revision)
    click.echo(f"database at {admin.settings.database_url} is at {revision}")


# -- tenants and API keys -------------------------------------------------------------------------------
@contextmanager
def _key_store(admin: Admin) -> Iterator[KeyStore]:
    """The store, with database failures told as what to do about them."""
    url = admin.settings.database_url
    try:
        shown = make_url(url).render_as_string(hide_password=True)
        store = KeyStore.from_settings(admin.settings)
    except ValueError as exc:  # LLMB_TENANT_* defaults out of range
        fail(f"invalid tenant defaults: {exc}")
    except SQLAlchemyError as exc:
        fail(f"invalid database URL {url!r}: {exc}")
    try:
        yield store
    except SQLAlchemyError as exc:
        _explain_database_error(store, shown, exc)


def _explain_database_error(store: KeyStore, shown: str, exc: SQLAlchemyError) -> NoReturn:
    try:
        tables = set(inspect(store.engine).get_table_names())
    except SQLAlchemyError:
        raise click.ClickException(f"cannot reach the database at {shown}: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from None
    if not {"tenants", "api_keys"} <= tables:
        raise click.ClickException(f"the database at {shown} has no tenant tables yet: run `llmb-admin db upgrade`")
    raise click.ClickException(f"database error at {shown}: {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: Exception) -> str:
    """SQLAlchemy's messages go on with the statement and a link: the first line says what happened."""
    return (str(exc).splitlines() or [""])[0]


def _policy_dict(p: TenantPolicy) -> dict[str, Any]:
    return {"name": p.name, "weight": p.weight, "max_in_flight": p.max_in_flight, "priority": p.priority.value}


def _key_dict(k: KeyInfo) -> dict[str, Any]:
    return {"id": k.id, "tenant": k.tenant, "admin": k.admin, "label": k.label,
            "created_at": k.created_at.isoformat(), "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}


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
    click.echo(f"revoked {key_id}; API processes refuse it within {admin.settings.auth_cache_s:g} s")


def main() -> None:
    cli(prog_name="llmb-admin")


if __name__ == "__main__":
    main()
