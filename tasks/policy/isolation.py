"""What to do with a batch that did not finish: a pure decision, tested without any broker.

- Its worker was lost before starting it (stranded): run all of it again elsewhere. Each item counts one
  retry; an item re-dispatched more than ``max_retries`` times fails with a clear error rather than
  circulating for ever. A batch a stopping worker handed back unstarted (returned) goes again whole and is
  charged nothing: a graceful stop is nobody's fault.
- It raised: one of its inputs may be poison. Split it in two and run each half again, recursively (a
  binary search: an innocent input beside a poison one is re-run at most log2(batch size) times, about 7
  for 100). A batch of one that raised has isolated its poison input: it fails alone, with 422, and is
  quarantined.
- Its worker died while running it: maybe an input killed it, maybe not (preemption, an OOM caused by a
  neighbour, a node drain, a rollout all kill innocent batches). Every item remembers the worker it died
  on. The first death of a batch sends it again whole (to another worker where there is one): the common,
  innocent death costs one re-run instead of a binary search. A second death splits it like a raise. A
  death counts as proof only when it repeats elsewhere: an item alone in its batch is poison once batches
  holding it have died on at least ``POISON_WORKERS`` different workers; until then it is run again alone.
  An item whose batches died more than ``max_retries`` times on one worker alone (a fleet of one) fails
  with a clear 503, unquarantined.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tasks.schema import Batch, BatchItem, Failure

POISON_WORKERS = 2  # distinct workers a lone input must have died on before its death is its own fault


@dataclass(frozen=True)
class Plan:
    batches: list[Batch] = field(default_factory=list)  # to dispatch again
    poison: list[BatchItem] = field(default_factory=list)  # isolated: fail with 422 and quarantine
    exhausted: list[BatchItem] = field(default_factory=list)  # lost too many workers: fail with 503


def is_poison(item: BatchItem) -> bool:
    """Did this item, alone in its batch, die on enough different workers to be blamed for it?"""
    return len(set(item.died_on)) >= POISON_WORKERS


def plan(batch: Batch, failure: Failure, *, now: float, max_retries: int = 3, died_on: str = "",
         new_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> Plan:
    """``died_on`` names the worker a DIED batch was running on."""
    items = batch.items
    if not items:
        return Plan()
    if failure is Failure.RETURNED:
        return Plan(batches=[batch.derive(new_id(), items, now=now)])
    if failure is Failure.STRANDED:
        retry = tuple(replace(i, retries=i.retries + 1) for i in items if i.retries < max_retries)
        exhausted = [i for i in items if i.retries >= max_retries]
        batches = [batch.derive(new_id(), retry, now=now)] if retry else []
        return Plan(batches=batches, exhausted=exhausted)
    if failure is Failure.DIED:
        items = tuple(replace(i, died_on=(*i.died_on, died_on or "?")) for i in items)
        if len(items) > 1 and max(len(i.died_on) for i in items) == 1:  # its first death: again, whole
            return Plan(batches=[batch.derive(new_id(), items, now=now)])
    if len(items) == 1:
        item = items[0]
        if failure is Failure.RAISED or is_poison(item):
            return Plan(poison=[item])
        if len(item.died_on) > max_retries:
            return Plan(exhausted=[item])
        return Plan(batches=[batch.derive(new_id(), items, now=now)])
    half = (len(items) + 1) // 2
    return Plan(batches=[batch.derive(new_id(), items[:half], now=now),
                         batch.derive(new_id(), items[half:], now=now)])


def avoid(batch: Batch) -> frozenset[str]:
    """Workers a batch should not go back to if another can take it: those its items died on."""
    return frozenset(w for i in batch.items for w in i.died_on)
