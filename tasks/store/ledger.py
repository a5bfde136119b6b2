"""The outcome ledger: what every batch did, which requests it carried, and which inputs are quarantined.

Here: the events processes record (one per batch), how each becomes upserts of the tables in
:mod:`tasks.store.models`, the ledger's queries, and which failed writes the database refused for what they hold
(:func:`refused_by_database`). Serving never waits for the database: processes hand events to the background
writer, :class:`tasks.store.ledger_writer.LedgerWriter`, which writes what has queued up in one transaction and
keeps events in a bounded buffer while the database is down.

One record the database refuses must not stop the rest. Text is made storable on the way in, and when a write
still fails because of what it holds, the writer writes those events again one at a time
(:meth:`Ledger.write`), and a refused event row by row (:meth:`Ledger.write_each`), dropping (logging and
counting) only the rows the database will not take.
"""
from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Table,
    bindparam,
    case,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, SQLAlchemyError, StatementError
from sqlalchemy.orm import Session

from tasks import tracing
from tasks.config import Settings
from tasks.schema import Batch, BatchItem, input_hash
from tasks.store.models import Base, BatchRecord, BatchRequest, QuarantineRecord, RequestRecord, make_engine

FINAL_STATUSES = ("ok", "poison", "expired", "exhausted", "rejected")


def ts(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=UTC)


# -- events: what processes hand to the writer, one per batch -------------------------------------------
@dataclass(frozen=True)
class BatchOutcome:
    """A batch ran (ok or raised), or was found dead or stranded; its requests get ``item_status``."""

    batch: Batch
    status: str
    item_status: str
    worker: str | None = None
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    run_ms: float | None = None
    tokens: Mapping[str, tuple[int, int]] | None = None  # ran: item id -> (prompt, completion) tokens it took


@dataclass(frozen=True)
class ItemsOutcome:
    """Requests that ended outside a successful run: expired before running, poison, retries exhausted."""

    model: str
    items: Sequence[BatchItem]
    status: str
    error: str | None = None
    batch_id: str | None = None


@dataclass(frozen=True)
class Quarantined:
    digest: str
    model: str
    reason: str
    batch_id: str
    item: BatchItem


@dataclass(frozen=True)
class Released:
    digest: str


LedgerEvent = BatchOutcome | ItemsOutcome | Quarantined | Released


@dataclass(frozen=True)
class _Write:
    """One statement and the rows it runs for: run whole (one executemany) or, to isolate a refusal, row by row."""

    table: str
    statement: Any
    rows: list[dict[str, Any]]
    key: tuple[str, ...]


class Ledger:
    """Writes ledger events, each in one transaction; usable directly (CLI, tests) or via
    :class:`tasks.store.ledger_writer.LedgerWriter`."""

    def __init__(self, engine: Engine, store_inputs: bool = False) -> None:
        self.engine = engine
        self.store_inputs = store_inputs

    @classmethod
    def from_settings(cls, settings: Settings) -> Ledger:
        return cls(make_engine(settings.stores.database_url), settings.stores.store_inputs)

    def write(self, ev: LedgerEvent) -> None:
        self.write_many([ev])

    def write_many(self, events: Iterable[LedgerEvent]) -> None:
        """Write these events in one transaction: all of them, or (on any error) none."""
        with self.engine.begin() as conn:
            for ev in events:
                for w in self._plan(ev):
                    conn.execute(w.statement, w.rows)

    def write_each(self, ev: LedgerEvent) -> list[str]:
        """Write one event row by row, each row in a transaction of its own, skipping the rows the database
        refuses; returns what was refused (table, key, why), one line per row.

        The slow path, taken only once writing the event whole has failed because of its contents. An error
        about the database rather than a row (connection lost) is raised: the caller retries, and the rows
        written so far are written again harmlessly (every write is an upsert).
        """
        refused: list[str] = []
        for w in self._plan(ev):
            for row in w.rows:
                try:
                    with self.engine.begin() as conn:
                        conn.execute(w.statement, [row])
                except Exception as exc:
                    if not refused_by_database(exc):
                        raise
                    key = ", ".join(f"{k}={row.get(k)!r}" for k in w.key)
                    refused.append(f"{w.table} ({key}): {type(exc).__name__}: {first_line(exc)}")
        return refused

    def release(self, digest: str) -> bool:
        """Mark this input's quarantine released; False when the ledger holds no unreleased record of it."""
        w = self._released(digest)
        with self.engine.begin() as conn:
            return bool(conn.execute(w.statement, w.rows).rowcount)

    def quarantined(self) -> list[dict[str, Any]]:
        """Every input quarantined and not released, oldest first, as :class:`tasks.state.quarantine.Quarantine`
        keeps its details (``hash``, ``model``, ``reason``, ``batch_id``, ``request_id``, ``since``)."""
        q = QuarantineRecord
        query = select(q).where(q.released_at.is_(None)).order_by(q.created_at)
        with Session(self.engine) as session:
            return [{"hash": r.input_hash, "model": r.model, "reason": r.reason, "batch_id": r.batch_id,
                     "request_id": r.request_id, "since": _utc(r.created_at).timestamp()}
                    for r in session.scalars(query)]

    # -- events as statements ------------------------------------------------------------------------
    def _plan(self, ev: LedgerEvent) -> list[_Write]:
        if isinstance(ev, BatchOutcome):
            writes = self._batch(ev)
        elif isinstance(ev, ItemsOutcome):
            writes = [self._requests(ev.model, ev.items, ev.status, ev.error, ev.batch_id)]
        elif isinstance(ev, Quarantined):
            writes = [self._upsert(QuarantineRecord, [{
                "input_hash": ev.digest, "model": ev.model, "reason": ev.reason, "batch_id": ev.batch_id,
                "request_id": ev.item.id, "input": ev.item.input if self.store_inputs else None,
                "created_at": datetime.now(UTC), "released_at": None}], "input_hash")]
        elif isinstance(ev, Released):
            writes = [self._released(ev.digest)]
        else:
            raise TypeError(f"not a ledger event: {ev!r}")
        return [w for w in writes if w.rows]

    def _batch(self, ev: BatchOutcome) -> list[_Write]:
        b = ev.batch
        done = ev.item_status == "ok"
        return [
            self._upsert(BatchRecord, [{
                "id": b.id, "parent_id": b.parent_id, "model": b.model, "worker": ev.worker, "size": len(b.items),
                "attempt": b.attempt, "status": ev.status, "error": ev.error, "created_at": ts(b.created_at),
                "started_at": ts(ev.started_at), "finished_at": ts(ev.finished_at), "run_ms": ev.run_ms}], "id"),
            self._upsert(BatchRequest, [{"batch_id": b.id, "request_id": i.id} for i in b.items],
                         ("batch_id", "request_id"), update=False),
            self._requests(b.model, b.items, ev.item_status, ev.error if not done else None, b.id,
                           started_at=ev.started_at, finished_at=ev.finished_at if done else None,
                           run_ms=ev.run_ms if done else None, tokens=ev.tokens if done else None),
        ]

    def _requests(self, model: str, items: Iterable[BatchItem], status: str, error: str | None,
                  batch_id: str | None, *, started_at: float | None = None, finished_at: float | None = None,
                  run_ms: float | None = None, tokens: Mapping[str, tuple[int, int]] | None = None) -> _Write:
        now = time.time()
        tokens = tokens or {}
        rows = [{
            "id": i.id, "correlation_id": i.request_id, "tenant": i.tenant, "model": model, "status": status,
            "input_hash": input_hash(model, i.input), "input": i.input if self.store_inputs else None,
            "params": json.dumps(p, sort_keys=True) if (p := i.params.to_dict()) else None,
            "priority": i.priority.value,
            "error": error, "batch_id": batch_id, "accepted_at": ts(i.accepted_at),
            "finished_at": ts(finished_at if finished_at is not None else now),
            "queued_ms": None if started_at is None else round((started_at - i.accepted_at) * 1000, 3),
            "run_ms": run_ms, "prompt_tokens": tokens[i.id][0] if i.id in tokens else None,
            "completion_tokens": tokens[i.id][1] if i.id in tokens else None,
            "trace_id": tracing.trace_id(i.trace), "adapter": i.params.adapter} for i in items]
        return self._upsert(RequestRecord, rows, "id", keep_final_status=True)

    def _upsert(self, model: type[Base], rows: list[dict[str, Any]], key: str | tuple[str, ...],
                update: bool = True, keep_final_status: bool = False) -> _Write:
        """INSERT ... ON CONFLICT for many rows in one executemany, in the dialect at hand.

        Records come from several processes in no guaranteed order; with ``keep_final_status`` a request
        that already reached a final status keeps it (a late "retrying" from a parent batch must not undo
        the "ok" of the half that succeeded).
        """
        keys = (key,) if isinstance(key, str) else key
        table: Table = model.__table__  # type: ignore[assignment]
        stmt = _upsert_statement(table, self.engine.dialect.name, keys, update, keep_final_status)
        return _Write(table.name, stmt, rows, keys)

    def _released(self, digest: str) -> _Write:
        return _Write(QuarantineRecord.__tablename__, _release_statement(),
                      [{"b_hash": digest, "b_at": datetime.now(UTC)}], ("b_hash",))


@functools.cache
def _upsert_statement(table: Table, dialect: str, keys: tuple[str, ...], update: bool, keep_final: bool) -> Any:
    """Built once per shape, so SQLAlchemy compiles it once: per-batch writes stay cheap."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    stmt = insert(table)
    if not update:
        return stmt.on_conflict_do_nothing(index_elements=list(keys))
    columns: dict[str, Any] = {c.name: stmt.excluded[c.name] for c in table.columns
                               if c.name not in keys and c.name != "accepted_at"}
    if keep_final:
        # literal values, not an IN (...) parameter list: executemany() cannot expand one
        final = or_(*(table.c.status == literal_column(f"'{status}'") for status in FINAL_STATUSES))
        for c in ("status", "error", "batch_id", "finished_at", "queued_ms", "run_ms"):
            columns[c] = case((final, table.c[c]), else_=stmt.excluded[c])
    return stmt.on_conflict_do_update(index_elements=list(keys), set_=columns)


@functools.cache
def _release_statement() -> Any:
    """Released keeps the time of the first release."""
    q = QuarantineRecord
    return (update(q).where(q.input_hash == bindparam("b_hash"), q.released_at.is_(None))
            .values(released_at=bindparam("b_at")))


def _utc(at: datetime) -> datetime:
    """SQLite hands back naive datetimes; the ledger writes UTC."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def first_line(exc: BaseException) -> str:
    """What the database said, without the statement and parameters SQLAlchemy appends (inputs among them)."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    return (str(orig).splitlines() or [""])[0]


def refused_by_database(exc: BaseException) -> bool:
    """Whether a failed write failed because of what it holds, so that writing it again can never succeed.

    Refused: a value the database will not take (``DataError``: too long, out of range, invalid), a constraint
    it breaks (``IntegrityError``), or a value that cannot even be sent (a ``StatementError`` SQLAlchemy raised
    while preparing parameters, or a plain ``TypeError``/``ValueError``/``UnicodeError`` from the driver).
    Not refused, so retried while events wait in the buffer: everything about reaching or using the database
    (``OperationalError``: connection lost, server down, database locked; ``ProgrammingError``: tables missing
    until ``llmb-admin db upgrade``; a pool timeout).
    """
    if isinstance(exc, (DataError, IntegrityError)):
        return True
    if isinstance(exc, DBAPIError):
        return False
    if isinstance(exc, StatementError):  # raised before the database saw the statement
        return True
    return not isinstance(exc, SQLAlchemyError)
