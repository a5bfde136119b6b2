"""The outcome ledger: what every batch did, which requests it carried, and which inputs are quarantined.

SQLAlchemy 2.x models (schema managed by Alembic in ``migrations/``) and a writer that keeps the database
off the hot path: processes hand it one event per batch, and a background thread writes each event in one
transaction. When the database is down, events wait in a bounded buffer and are retried; beyond the bound
they are dropped, counted and logged. Serving never waits for the database.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Table,
    Text,
    case,
    create_engine,
    event,
    literal_column,
    or_,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from tasks.schema import Batch, BatchItem, input_hash

log = logging.getLogger("llmb.ledger")


FINAL_STATUSES = ("ok", "poison", "expired", "exhausted", "rejected")


class Base(DeclarativeBase):
    pass


class RequestRecord(Base):
    """One input (batch item) and its final outcome."""

    __tablename__ = "requests"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # item id
    correlation_id: Mapped[str] = mapped_column(String(128), index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # ok, retrying, poison, expired, exhausted, rejected
    input_hash: Mapped[str] = mapped_column(String(32), index=True)
    input: Mapped[str | None] = mapped_column(Text)  # only with LLMB_STORE_INPUTS
    error: Mapped[str | None] = mapped_column(Text)
    batch_id: Mapped[str | None] = mapped_column(String(64))  # the last batch that carried it
    accepted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    queued_ms: Mapped[float | None] = mapped_column(Float)
    run_ms: Mapped[float | None] = mapped_column(Float)


class BatchRecord(Base):
    """One batch as run (or failed) on one worker; splits point to their parent."""

    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(String(64), index=True)
    model: Mapped[str] = mapped_column(String(128))
    worker: Mapped[str | None] = mapped_column(String(255), index=True)
    size: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), index=True)  # ok, raised, died, reassigned
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    run_ms: Mapped[float | None] = mapped_column(Float)


class BatchRequest(Base):
    """Which requests a batch carried."""

    __tablename__ = "batch_requests"
    batch_id: Mapped[str] = mapped_column(String(64), ForeignKey("batches.id", ondelete="CASCADE"),
                                          primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)


class QuarantineRecord(Base):
    """An input that failed alone; refused at the door until released."""

    __tablename__ = "quarantined_inputs"
    input_hash: Mapped[str] = mapped_column(String(32), primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    batch_id: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(64))
    input: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    released_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


def ts(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=timezone.utc)


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


def make_engine(url: str) -> Engine:
    """An engine that several processes can share a SQLite file through (WAL, waiting on locks)."""
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


class Ledger:
    """Writes ledger events, each in one transaction; usable directly (CLI, tests) or via LedgerWriter."""

    def __init__(self, engine: Engine, store_inputs: bool = False) -> None:
        self.engine = engine
        self.store_inputs = store_inputs

    def write(self, ev: LedgerEvent) -> None:
        with Session(self.engine) as session, session.begin():
            if isinstance(ev, BatchOutcome):
                self._batch(session, ev)
            elif isinstance(ev, ItemsOutcome):
                self._upsert_requests(session, ev.model, ev.items, ev.status, ev.error, ev.batch_id)
            elif isinstance(ev, Quarantined):
                self._upsert(session, QuarantineRecord, [{
                    "input_hash": ev.digest, "model": ev.model, "reason": ev.reason, "batch_id": ev.batch_id,
                    "request_id": ev.item.id, "input": ev.item.input if self.store_inputs else None,
                    "created_at": datetime.now(timezone.utc), "released_at": None}], "input_hash")
            elif isinstance(ev, Released):
                record = session.get(QuarantineRecord, ev.digest)
                if record is not None:
                    record.released_at = datetime.now(timezone.utc)

    def _batch(self, session: Session, ev: BatchOutcome) -> None:
        b = ev.batch
        self._upsert(session, BatchRecord, [{
            "id": b.id, "parent_id": b.parent_id, "model": b.model, "worker": ev.worker, "size": len(b.items),
            "attempt": b.attempt, "status": ev.status, "error": ev.error, "created_at": ts(b.created_at),
            "started_at": ts(ev.started_at), "finished_at": ts(ev.finished_at), "run_ms": ev.run_ms}], "id")
        self._upsert(session, BatchRequest, [{"batch_id": b.id, "request_id": i.id} for i in b.items],
                     ("batch_id", "request_id"), update=False)
        done = ev.item_status == "ok"
        self._upsert_requests(session, b.model, b.items, ev.item_status, ev.error if not done else None, b.id,
                              started_at=ev.started_at, finished_at=ev.finished_at if done else None,
                              run_ms=ev.run_ms if done else None)

    def _upsert_requests(self, session: Session, model: str, items: Iterable[BatchItem], status: str,
                         error: str | None, batch_id: str | None, *, started_at: float | None = None,
                         finished_at: float | None = None, run_ms: float | None = None) -> None:
        now = time.time()
        rows = [{
            "id": i.id, "correlation_id": i.request_id, "tenant": i.tenant, "model": model, "status": status,
            "input_hash": input_hash(model, i.input), "input": i.input if self.store_inputs else None,
            "error": error, "batch_id": batch_id, "accepted_at": ts(i.accepted_at),
            "finished_at": ts(finished_at if finished_at is not None else now),
            "queued_ms": None if started_at is None else round((started_at - i.accepted_at) * 1000, 3),
            "run_ms": run_ms} for i in items]
        if rows:
            self._upsert(session, RequestRecord, rows, "id", keep_final_status=True)

    @staticmethod
    def _upsert(session: Session, model: type[Base], rows: list[dict[str, Any]], key: str | tuple[str, ...],
                update: bool = True, keep_final_status: bool = False) -> None:
        """INSERT ... ON CONFLICT for many rows in one executemany, in the dialect at hand.

        Records come from several processes in no guaranteed order; with ``keep_final_status`` a request
        that already reached a final status keeps it (a late "retrying" from a parent batch must not undo
        the "ok" of the half that succeeded).
        """
        if rows:
            dialect = session.get_bind().dialect.name
            keys = (key,) if isinstance(key, str) else key
            stmt = _upsert_statement(model.__table__, dialect, keys, update, keep_final_status)  # type: ignore[arg-type]
            session.execute(stmt, rows)


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


@dataclass
class LedgerWriter:
    """Background writer: ``record`` never blocks and never raises."""

    ledger: Ledger
    max_buffer: int = 10_000
    on_drop: Callable[[int], object] = lambda n: None
    retry_s: float = 2.0
    _queue: queue.Queue[LedgerEvent | None] = field(init=False)
    _thread: threading.Thread = field(init=False)
    dropped: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._queue = queue.Queue(maxsize=self.max_buffer)
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def record(self, ev: LedgerEvent) -> None:
        try:
            self._queue.put_nowait(ev)
        except queue.Full:
            self._drop(1)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything recorded so far is written (tests, shutdown). False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass

    def _drop(self, n: int) -> None:
        self.dropped += n
        log.warning("ledger buffer full: dropped %d record(s) (%d in all)", n, self.dropped)
        try:
            self.on_drop(n)
        except Exception:  # counting is best effort
            pass

    def _run(self) -> None:
        while True:
            ev = self._queue.get()
            if ev is None:
                self._queue.task_done()
                return
            while True:
                try:
                    self.ledger.write(ev)
                    break
                except SQLAlchemyError as exc:
                    log.warning("ledger write failed (%s); retrying in %g s with %d record(s) waiting",
                                type(exc).__name__, self.retry_s, self._queue.qsize())
                    time.sleep(self.retry_s)
                except Exception:
                    log.exception("ledger record could not be written; dropped")
                    self._drop(1)
                    break
            self._queue.task_done()
