"""Adapter-aware routing: send an item naming a LoRA adapter to a worker that holds it, or can load it (pure).

A worker serves a call of an adapter at the base model's price only once the adapter is in its device memory; a
load takes milliseconds to tens of them, and a worker holds at most ``LLMB_MAX_ADAPTERS`` (least recently used
evicted). So where an item runs decides whether it waits for a load, and whether it evicts an adapter that
another tenant's calls will need next. The Gateway API Inference Extension and llm-d score each server for an
item's adapter (:func:`adapter_score`): 1.0 when it is resident there, 0.8 when the server has room to load it,
0.6 when it is loading there already, 0 otherwise; this module does the same, and weighs the score, as their
scorers are weighed, with the prefix-cache score and the load of :mod:`tasks.policy.prefixes`:
``ADAPTER_WEIGHT x adapter score + PREFIX_WEIGHT x share of the prompt start held - LOAD_WEIGHT x load``.
``ADAPTER_WEIGHT`` 3: a worker holding the adapter wins over one with room unless it is loaded by 30% of its
capacity more; over one that can neither hold nor load it, always.

What each worker holds comes from its heartbeats (``adapters``, ``adapters_loading``, ``max_adapters``); between
heartbeats, what the batcher sent to a worker counts as held there (it will be once the batch runs), for
:data:`SENT_KEPT_S`, as :class:`~tasks.policy.prefixes.PrefixIndex` does for prompt starts: as resident when no
other worker reports it resident (a cold adapter's first item goes where there is room, the least loaded such
worker, and its next items follow it), as loading when another does (a hot adapter's calls keep going to the
workers that hold it rather than pile onto the one still loading it). A hot adapter is replicated: the choice is
only ever among the workers able to take a batch now (:mod:`tasks.policy.scheduler`: outstanding limit,
backlog, KV room), so while the workers holding it are full its items go where there is room, and that worker
holds it too from then on.

Items without an adapter, and workers that serve none (``max_adapters`` 0), are not scored: nothing changes
for them. ``enabled`` False (``LLMB_ADAPTER_ROUTING=false``) is the adapter-blind baseline of the bench.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tasks.policy.prefixes import LOAD_WEIGHT, PREFIX_WEIGHT, Option
from tasks.schema import WorkerInfo

RESIDENT, ROOM, LOADING, NONE = 1.0, 0.8, 0.6, 0.0  # the Inference Extension's LoRA affinity scores
ADAPTER_WEIGHT = 3.0
SENT_KEPT_S = 5.0  # an adapter sent to a worker counts as resident there this long, whatever its reports say


@dataclass
class _Worker:
    capacity: int = 0
    resident: frozenset[str] = frozenset()
    loading: frozenset[str] = frozenset()
    reported_at: float = float("-inf")
    sent: deque[tuple[float, str]] = field(default_factory=deque)  # (when, adapter), oldest first


class AdapterIndex:
    """Which adapters each worker holds and is loading: its last heartbeat, plus what was sent to it since."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # wall clock, as heartbeats are dated
        self._workers: dict[str, _Worker] = {}

    def report(self, worker: WorkerInfo) -> None:
        """A worker's heartbeat; one no newer than the report in use is ignored."""
        w = self._workers.setdefault(worker.id, _Worker())
        if worker.heartbeat_at <= w.reported_at:
            return
        w.capacity, w.reported_at = worker.max_adapters, worker.heartbeat_at
        w.resident, w.loading = frozenset(worker.adapters), frozenset(worker.adapters_loading)

    def sent(self, worker_id: str, adapters: Sequence[str]) -> None:
        w = self._workers.setdefault(worker_id, _Worker())
        now = self.clock()
        w.sent.extend((now, a) for a in adapters)
        self._trim(w, now)

    def serves(self, worker_id: str) -> bool:
        """Whether the worker reports that it serves adapters at all."""
        w = self._workers.get(worker_id)
        return w is not None and w.capacity > 0

    def held(self, worker_id: str) -> frozenset[str]:
        """Resident by its report, or sent to it lately."""
        w = self._workers.get(worker_id)
        if w is None:
            return frozenset()
        self._trim(w, self.clock())
        return w.resident | {a for _, a in w.sent}

    def score(self, worker_id: str, adapter: str) -> float:
        """The Inference Extension's score of this worker for ``adapter``: 1.0 resident (or sent lately), 0.8
        room to load it, 0.6 loading it already, 0 otherwise (full, or it serves no adapters)."""
        w = self._workers.get(worker_id)
        if w is None or w.capacity <= 0:
            return NONE
        held = self.held(worker_id)
        if adapter in w.resident:
            return RESIDENT
        if adapter in held:  # sent lately, not reported yet: resident soon, but loading now
            return LOADING if self._reported_elsewhere(worker_id, adapter) else RESIDENT
        if len(held | w.loading) < w.capacity:
            return ROOM
        return LOADING if adapter in w.loading else NONE

    def _reported_elsewhere(self, worker_id: str, adapter: str) -> bool:
        return any(adapter in w.resident for wid, w in self._workers.items() if wid != worker_id)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    @staticmethod
    def _trim(w: _Worker, now: float) -> None:
        while w.sent and w.sent[0][0] < now - SENT_KEPT_S:
            w.sent.popleft()


def assign(adapters: Sequence[str | None], options: Sequence[Option], index: AdapterIndex,
           prefix_share: Callable[[int, int], float], default: Sequence[int]) -> list[int]:
    """For each item (its adapter, None for the base model), the position in ``options`` (the scheduler's
    order, best first) of the worker it goes to: the highest ``ADAPTER_WEIGHT x adapter score + PREFIX_WEIGHT x
    prefix_share(item, option) - LOAD_WEIGHT x load``, ties to the scheduler's order. An item of the base model
    keeps its ``default`` position (prefix-aware routing's choice); so does one no option can serve. Each choice
    counts at once: the next item of the same adapter scores that worker as holding it."""
    out = list(default)
    for i, adapter in enumerate(adapters):
        if adapter is None:
            continue
        scores = [index.score(o.worker_id, adapter) for o in options]
        if not any(scores):
            continue
        best, best_score = out[i], float("-inf")
        for j, option in enumerate(options):
            score = ADAPTER_WEIGHT * scores[j] + PREFIX_WEIGHT * prefix_share(i, j) - LOAD_WEIGHT * option.load
            if score > best_score:
                best, best_score = j, score
        out[i] = best
        if scores[best] != RESIDENT:
            index.sent(options[best].worker_id, [adapter])
    return out
