"""The outcome ledger on real databases: migrations both ways, writes, a database outage, refused records."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from sqlalchemy import inspect, select
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError, StatementError
from sqlalchemy.orm import Session

from harness.stack import BIN, ROOT
from tasks.schema import Batch, BatchItem
from tasks.store.ledger import (
    BatchOutcome,
    ItemsOutcome,
    Ledger,
    Quarantined,
    Released,
    refused_by_database,
)
from tasks.store.ledger_writer import LedgerWriter
from tasks.store.models import (
    BatchRecord,
    BatchRequest,
    QuarantineRecord,
    RequestRecord,
    StorableString,
    make_engine,
    storable,
)

TABLES = {"requests", "batches", "batch_requests", "quarantined_inputs", "tenants", "api_keys"}


def admin(url: str, *args: str) -> None:
    import subprocess

    done = subprocess.run([str(BIN / "llmb-admin"), "--database-url", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def items(n: int, prefix: str = "i") -> tuple[BatchItem, ...]:
    now = time.time()
    return tuple(BatchItem(id=f"{prefix}{k}", request_id=f"corr-{k}", input=f"text {k}", deadline=now + 30,
                           accepted_at=now, reply_to="c", tenant="team-a") for k in range(n))


def test_migrations_upgrade_and_downgrade_cleanly(database_url: str) -> None:
    engine = make_engine(database_url)
    admin(database_url, "db", "upgrade")
    assert set(inspect(engine).get_table_names()) >= TABLES
    admin(database_url, "db", "downgrade", "base")
    assert not TABLES & set(inspect(make_engine(database_url)).get_table_names())
    admin(database_url, "db", "upgrade")
    assert set(inspect(make_engine(database_url)).get_table_names()) >= TABLES


def test_one_transaction_per_batch_records_the_split_tree(database_url: str) -> None:
    admin(database_url, "db", "upgrade")
    ledger = Ledger(make_engine(database_url), store_inputs=True)
    root = Batch(id="root", model="sim", items=items(4), created_at=time.time())
    left = root.derive("left", root.items[:2], now=time.time())
    right = root.derive("right", root.items[2:], now=time.time())
    ledger.write(BatchOutcome(right, "ok", "ok", "gpu1@h", None, time.time(), time.time(), 250.0))
    ledger.write(BatchOutcome(root, "raised", "retrying", "gpu0@h", "boom", time.time(), time.time(), 10.0))
    ledger.write(BatchOutcome(left, "raised", "retrying", "gpu2@h", "boom", time.time(), time.time(), 10.0))
    ledger.write(ItemsOutcome("sim", left.items[:1], "poison", "boom", "left"))
    ledger.write(Quarantined("abc", "sim", "fails alone", "left", left.items[0]))
    with Session(make_engine(database_url)) as s:
        tree = {b.id: (b.parent_id, b.size, b.status, b.attempt) for b in s.scalars(select(BatchRecord))}
        assert tree == {"root": (None, 4, "raised", 0), "left": ("root", 2, "raised", 1), "right": ("root", 2, "ok", 1)}
        status = {r.id: r.status for r in s.scalars(select(RequestRecord))}
        # "right" succeeded before its parent's failure was recorded: a late "retrying" does not undo "ok"
        assert status == {"i0": "poison", "i1": "retrying", "i2": "ok", "i3": "ok"}
        request = s.get(RequestRecord, "i2")
        assert request is not None and request.input == "text 2" and request.tenant == "team-a"
        assert len(list(s.scalars(select(BatchRequest)))) == 8
        held = s.get(QuarantineRecord, "abc")
        assert held is not None and held.released_at is None
    ledger.write(Released("abc"))
    with Session(make_engine(database_url)) as s:
        released = s.get(QuarantineRecord, "abc")
        assert released is not None and released.released_at is not None


def test_a_database_outage_never_blocks_and_overflow_is_counted() -> None:
    dropped: list[int] = []
    writer = LedgerWriter(Ledger(make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none")), max_buffer=5,
                          on_drop=dropped.append, retry_s=0.2)
    started = time.monotonic()
    for k in range(20):
        writer.record(ItemsOutcome("sim", items(1, prefix=f"x{k}-"), "expired"))
    assert time.monotonic() - started < 0.5, "recording must not wait for the database"
    assert writer.dropped >= 14 and sum(dropped) == writer.dropped
    assert not writer.flush(timeout_s=0.5)
    writer.close(timeout_s=0.1)  # the database is still away: what is left is dropped, not retried for ever
    assert writer.flush(timeout_s=5) and writer.dropped == 20 and sum(dropped) == 20


# -- one record the database refuses must not stop the writer ------------------------------------------------
def writer_for(url: str, **kwargs: object) -> tuple[LedgerWriter, list[int]]:
    dropped: list[int] = []
    ledger = kwargs.pop("ledger", None) or Ledger(make_engine(url), store_inputs=True)
    return LedgerWriter(ledger, on_drop=dropped.append, retry_s=0.1, **kwargs), dropped  # type: ignore[arg-type]


def stored(url: str) -> dict[str, RequestRecord]:
    with Session(make_engine(url)) as s:
        return {r.id: r for r in s.scalars(select(RequestRecord))}


def test_every_text_column_of_the_ledger_is_made_storable() -> None:
    from tasks.store.models import Base

    for table in ("requests", "batches", "batch_requests", "quarantined_inputs"):
        for column in Base.metadata.tables[table].columns:
            if column.type.python_type is str:
                assert isinstance(column.type, StorableString), f"{table}.{column.name} is not StorableString"
    assert storable("a\x00b") == "a\ufffdb"
    assert storable("lone \ud800 surrogate") == "lone \ufffd surrogate"
    assert storable("ordinary text, é, 日本") == "ordinary text, é, 日本"


def test_which_failures_are_about_the_record() -> None:
    orig = Exception("from the driver")
    assert refused_by_database(DataError("INSERT", {}, orig))
    assert refused_by_database(IntegrityError("INSERT", {}, orig))
    assert refused_by_database(StatementError("bad parameter", "INSERT", {}, TypeError("not a datetime")))
    assert refused_by_database(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert not refused_by_database(OperationalError("INSERT", {}, orig))  # the database is away: wait
    assert not refused_by_database(ProgrammingError("INSERT", {}, orig))  # tables missing: db upgrade


def test_a_nul_in_an_input_is_stored_and_the_writer_goes_on(database_url: str) -> None:
    """PostgreSQL refuses NUL in text: the writer used to retry that record forever, writing nothing else."""
    admin(database_url, "db", "upgrade")
    writer, dropped = writer_for(database_url)
    before, after = items(2, prefix="before-"), items(2, prefix="after-")
    nul = (BatchItem(id="nul", request_id="corr-nul", input="a\x00b", deadline=time.time() + 30,
                     accepted_at=time.time(), reply_to="c", tenant="team-a"),)
    writer.record(ItemsOutcome("sim", before, "expired"))
    writer.record(BatchOutcome(Batch(id="b-nul", model="sim", items=nul + before, created_at=time.time()), "raised",
                               "retrying", "gpu0@h", "model said \x00", time.time(), time.time(), 1.0))
    writer.record(Quarantined("h-nul", "sim", "fails alone: \x00", "b-nul", nul[0]))
    writer.record(ItemsOutcome("sim", after, "expired"))
    assert writer.flush(timeout_s=10), "the ledger writer is stuck"
    rows = stored(database_url)
    assert {"before-0", "before-1", "nul", "after-0", "after-1"} <= set(rows)
    assert rows["nul"].input == "a\ufffdb" and rows["nul"].error == "model said \ufffd"
    with Session(make_engine(database_url)) as s:
        q = s.get(QuarantineRecord, "h-nul")
        assert q is not None and q.input == "a\ufffdb" and q.reason == "fails alone: \ufffd"
    writer.record(ItemsOutcome("sim", items(1, prefix="later-"), "expired"))
    assert writer.flush(timeout_s=10) and "later-0" in stored(database_url)
    assert writer.dropped == 0 and dropped == []


class GatedLedger(Ledger):
    """A real ledger whose first write waits at a gate, so that what is recorded meanwhile queues up."""

    def __init__(self, url: str) -> None:
        super().__init__(make_engine(url), store_inputs=True)
        self.reached, self.gate = threading.Event(), threading.Event()
        self.group_sizes: list[int] = []

    def write_many(self, events: Iterable[object]) -> None:
        events = list(events)
        self.reached.set()
        self.gate.wait(10)
        self.group_sizes.append(len(events))
        super().write_many(events)  # type: ignore[arg-type]


def test_a_record_the_database_refuses_is_dropped_alone_and_the_writer_goes_on(database_url: str) -> None:
    admin(database_url, "db", "upgrade")
    ledger = GatedLedger(database_url)
    writer, dropped = writer_for(database_url, ledger=ledger)
    writer.record(ItemsOutcome("sim", items(1, prefix="first-"), "expired"))
    assert ledger.reached.wait(10)  # the writer holds the first event; the rest queue up behind it
    now = time.time()
    no_time = BatchItem(id="no-time", request_id="c", input="x", deadline=now + 30, accepted_at=None,  # type: ignore[arg-type]
                        reply_to="c")  # accepted_at is NOT NULL: an IntegrityError in both databases
    long_tenant = BatchItem(id="long-tenant", request_id="c", input="x", deadline=now + 30, accepted_at=now,
                            reply_to="c", tenant="t" * 100)  # over String(64): PostgreSQL refuses it
    writer.record(ItemsOutcome("sim", items(2, prefix="a-"), "expired"))
    mixed = Batch(id="mixed", model="sim", items=(no_time, *items(2, prefix="m-")), created_at=now)
    writer.record(BatchOutcome(mixed, "died", "retrying", "gpu0@h", "worker died", finished_at=now))
    writer.record(ItemsOutcome("sim", (long_tenant,), "expired"))
    writer.record(Quarantined("h-none", "sim", "fails alone", None, items(1)[0]))  # type: ignore[arg-type]
    writer.record(ItemsOutcome("sim", items(2, prefix="z-"), "expired"))
    ledger.gate.set()
    assert writer.flush(timeout_s=20), "the ledger writer is stuck"
    assert ledger.group_sizes[:2] == [1, 5], "what queued up is written in one transaction first"
    rows = stored(database_url)
    assert {"first-0", "a-0", "a-1", "m-0", "m-1", "z-0", "z-1"} <= set(rows)
    assert "no-time" not in rows
    with Session(make_engine(database_url)) as s:
        assert s.get(BatchRecord, "mixed") is not None  # the batch and its valid items were written row by row
        assert s.get(QuarantineRecord, "h-none") is None
    refused = 2 if database_url.startswith("sqlite") else 3  # SQLite does not enforce String(64)
    assert ("long-tenant" in rows) == database_url.startswith("sqlite")
    assert writer.refused == writer.dropped == sum(dropped) == refused
    writer.record(ItemsOutcome("sim", items(1, prefix="later-"), "expired"))
    assert writer.flush(timeout_s=10) and "later-0" in stored(database_url)


def test_a_missing_table_is_waited_for_not_dropped(database_url: str) -> None:
    """Only errors about a record drop it; the database being unusable (here: not migrated yet) is retried."""
    writer, dropped = writer_for(database_url)
    writer.record(ItemsOutcome("sim", items(2, prefix="early-"), "expired"))
    assert not writer.flush(timeout_s=0.5)
    admin(database_url, "db", "upgrade")
    assert writer.flush(timeout_s=10)
    assert {"early-0", "early-1"} <= set(stored(database_url)) and dropped == []
