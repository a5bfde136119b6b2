"""Which worker gets the next batch: a pure decision over the fleet view.

Least outstanding work, never round-robin. The batcher counts the batches it has sent each worker and not
yet heard back about (workers announce every finished batch on the fleet exchange). A worker already
holding ``max_outstanding`` batches (default 2: one running, the next waiting, so the device never idles)
gets no more: :meth:`choose` returns None and the batcher keeps accumulating, so batches grow toward full
size while every device is busy, at no latency cost (work conservation).

``now`` is the caller's monotonic clock; an outstanding batch not heard of for ``forget_after_s`` is
forgotten so that a lost announcement cannot block a worker for ever.
"""
from __future__ import annotations

from collections.abc import Iterable

from tasks.fleet import WorkerInfo


class Scheduler:
    def __init__(self, max_outstanding: int = 2, forget_after_s: float = 60.0) -> None:
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be at least 1")
        self.max_outstanding = max_outstanding
        self.forget_after_s = forget_after_s
        self._outstanding: dict[str, dict[str, float]] = {}  # worker id -> {batch id: sent at}
        self._last_sent: dict[str, float] = {}

    def outstanding(self, worker_id: str, now: float) -> int:
        batches = self._outstanding.get(worker_id)
        if not batches:
            return 0
        for batch_id, sent_at in list(batches.items()):
            if now - sent_at > self.forget_after_s:
                del batches[batch_id]
        return len(batches)

    def choose(self, workers: Iterable[WorkerInfo], model: str, now: float) -> WorkerInfo | None:
        """The live worker serving ``model`` with the fewest outstanding batches, or None if all are full."""
        candidates = [(self.outstanding(w.id, now), self._last_sent.get(w.id, 0.0), w.id, w)
                      for w in workers if w.model == model]
        free = [c for c in candidates if c[0] < self.max_outstanding]
        return min(free, key=lambda c: c[:3])[3] if free else None

    def sent(self, worker_id: str, batch_id: str, now: float) -> None:
        self._outstanding.setdefault(worker_id, {})[batch_id] = now
        self._last_sent[worker_id] = now

    def finished(self, worker_id: str, batch_id: str) -> bool:
        """Record a worker's announcement; True if it freed a slot this scheduler was counting."""
        return self._outstanding.get(worker_id, {}).pop(batch_id, None) is not None

    def forget_worker(self, worker_id: str) -> None:
        self._outstanding.pop(worker_id, None)
        self._last_sent.pop(worker_id, None)
