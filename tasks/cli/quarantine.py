"""`llmb-admin quarantine`: list and release inputs that failed alone and are refused at the door.

The ledger holds the durable record and Redis the copy that is enforced; both commands use both.
"""
from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click
import redis
from sqlalchemy.exc import SQLAlchemyError

from tasks.cli.main import Admin, cli, fail, first_line, pass_admin, shown_url


@cli.group()
def quarantine() -> None:
    """Inputs that failed alone and are refused until released."""


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
    q = admin.quarantine()
    problems: list[str] = []
    durable: list[dict[str, Any]] = []
    live: list[dict[str, Any]] = []
    enforced: set[str] | None = None
    try:
        durable = admin.ledger().quarantined()
    except SQLAlchemyError as exc:
        problems.append(f"cannot read the ledger at {shown_url(s.stores.database_url)}: "
                        f"{first_line(exc, s.stores.database_url)}")
    try:
        live, enforced = q.list(), q.members()
    except redis.RedisError as exc:
        problems.append(f"cannot reach Redis at {shown_url(s.stores.redis_url)}: {first_line(exc, s.stores.redis_url)}")
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
        since = datetime.fromtimestamp(e["since"], tz=UTC).isoformat(timespec="seconds")
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
        in_ledger = admin.ledger().release(digest)
    except SQLAlchemyError as exc:
        click.echo(f"warning: cannot record the release in the ledger at {shown_url(s.stores.database_url)} "
                   f"({first_line(exc, s.stores.database_url)}): the input is accepted again now, but a "
                   "restarted Redis would refuse it again; run this command once more when the database is "
                   "reachable", err=True)
    try:
        in_redis = admin.quarantine().release(digest)
    except redis.RedisError as exc:
        recorded = " (the ledger records it as released; run this again to release it in Redis)" if in_ledger else ""
        fail(f"cannot reach Redis at {shown_url(s.stores.redis_url)}: {first_line(exc, s.stores.redis_url)}{recorded}")
    if not in_redis and in_ledger is None:
        fail(f"{digest} is not quarantined in Redis, and the ledger, which may still hold it, cannot be reached: "
             "run this again when the database is reachable")
    if not in_redis and not in_ledger:
        fail(f"{digest} is not quarantined (see `llmb-admin quarantine list`)")
    click.echo(f"released {digest}")
