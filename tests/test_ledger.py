"""The outcome ledger on real databases: migrations both ways, writes, and a database outage."""
from __future__ import annotations

import time

from sqlalchemy import inspect, select
from sqlalchemy.orm import Session

from tasks.ledger import (
    BatchOutcome,
    BatchRecord,
    BatchRequest,
    ItemsOutcome,
    Ledger,
    LedgerWriter,
    Quarantined,
    QuarantineRecord,
    Released,
    RequestRecord,
    make_engine,
)
from tasks.schema import Batch, BatchItem
from tests.stack import BIN, ROOT

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
    assert TABLES <= set(inspect(engine).get_table_names())
    admin(database_url, "db", "downgrade", "base")
    assert not TABLES & set(inspect(make_engine(database_url)).get_table_names())
    admin(database_url, "db", "upgrade")
    assert TABLES <= set(inspect(make_engine(database_url)).get_table_names())


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
        assert s.get(RequestRecord, "i2").input == "text 2" and s.get(RequestRecord, "i2").tenant == "team-a"
        assert len(list(s.scalars(select(BatchRequest)))) == 8
        assert s.get(QuarantineRecord, "abc").released_at is None
    ledger.write(Released("abc"))
    with Session(make_engine(database_url)) as s:
        assert s.get(QuarantineRecord, "abc").released_at is not None


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
