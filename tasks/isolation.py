"""What to do with a batch that did not finish: a pure decision, tested without any broker.

- Its worker was lost before starting it (stranded): run all of it again elsewhere. Each item counts one
  retry; an item re-dispatched more than ``max_retries`` times fails with a clear error rather than
  circulating for ever.
- It raised, or its worker died while running it: one of its inputs may be poison. Split it in two and
  run each half again, recursively (a binary search: an innocent input beside a poison one is re-run at
  most log2(batch size) times, about 7 for 100). A batch of one that fails has isolated its poison input:
  that input fails alone, with 422, and is quarantined.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tasks.schema import Batch, BatchItem, Failure


@dataclass(frozen=True)
class Plan:
    batches: list[Batch] = field(default_factory=list)  # to dispatch again
    poison: list[BatchItem] = field(default_factory=list)  # isolated: fail with 422 and quarantine
    exhausted: list[BatchItem] = field(default_factory=list)  # lost too many workers: fail with 503


def plan(batch: Batch, failure: Failure, *, now: float, max_retries: int = 3,
         new_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> Plan:
    items = batch.items
    if not items:
        return Plan()
    if failure is Failure.STRANDED:
        retry = tuple(replace(i, retries=i.retries + 1) for i in items if i.retries < max_retries)
        exhausted = [i for i in items if i.retries >= max_retries]
        batches = [batch.derive(new_id(), retry, now=now)] if retry else []
        return Plan(batches=batches, exhausted=exhausted)
    if len(items) == 1:
        return Plan(poison=list(items))
    half = (len(items) + 1) // 2
    return Plan(batches=[batch.derive(new_id(), items[:half], now=now),
                         batch.derive(new_id(), items[half:], now=now)])
