"""What the outcome ledger (SQL) says of a benchmark run: the batches a worker ran to their end, with their times,
and which calls each one carried."""
from __future__ import annotations

import datetime as dt

from harness.stack import Stack


def ledger_batches(stack: Stack, worker: str) -> list[tuple[str, float, float, int]]:
    """(id, started, finished, size) of every batch the worker ran to its end, from the ledger."""
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from tasks.store.models import BatchRecord

    engine = create_engine(stack.database_url)
    try:
        with Session(engine) as session:
            rows = session.execute(select(BatchRecord.id, BatchRecord.started_at, BatchRecord.finished_at,
                                          BatchRecord.size)
                                   .where(BatchRecord.worker == worker, BatchRecord.status == "ok")).all()
    finally:
        engine.dispose()

    def epoch(d: dt.datetime) -> float:
        return (d if d.tzinfo else d.replace(tzinfo=dt.UTC)).timestamp()

    return [(r[0], epoch(r[1]), epoch(r[2]), int(r[3])) for r in rows if r[1] is not None and r[2] is not None]


def batch_members(stack: Stack, batch_ids: set[str]) -> dict[str, list[str]]:
    """The correlation ids (X-Request-Id) of the calls each batch carried, from the ledger."""
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from tasks.store.models import BatchRequest, RequestRecord

    engine = create_engine(stack.database_url)
    try:
        with Session(engine) as session:
            rows = session.execute(select(BatchRequest.batch_id, RequestRecord.correlation_id)
                                   .join(RequestRecord, RequestRecord.id == BatchRequest.request_id)).all()
    finally:
        engine.dispose()
    members: dict[str, list[str]] = {}
    for batch_id, correlation in rows:
        if batch_id in batch_ids:
            members.setdefault(batch_id, []).append(correlation)
    return members
