"""A burst (good queue) told from a standing queue (bad queue), for admission (pure: the clock is injected).

A burst into an idle fleet and a steady overload look alike at admission: a full line. They differ in what
follows: a burst's line drains and empties, a steady overload's never does. One static margin on the line
(``LLMB_QUEUE_SHARE`` at 0.75, as it was) refused a third of what an idle 400/s device could answer of 3,000 calls
at once; without it, a steady overload's callers would wait to their deadlines.

So, as CoDel does for RPC queues (Facebook's "Fail at Scale": "if the queue has not been empty for the last N ms,
the time spent in the queue is limited to M ms"; Netflix's concurrency-limits): a model's line that has not
emptied (no more than one batch per worker in flight) for ``interval_s`` is standing, and admission then keeps a
margin (``LLMB_QUEUE_STANDING_SHARE`` of what the fleet answers before the deadline) and, when an operator sets
one, CoDel's absolute target (``target_s``, ``LLMB_QUEUE_TARGET_MS``); a line that emptied within the interval (a
burst) may fill all the fleet can answer before each caller's deadline. The interval is longer than a burst takes
to arrive and be let in (the door bounds a call's wait for its turn at admission), so the whole of a burst is
judged as good queue; a steady overload becomes standing after one interval and sheds at arrival from then on,
until its line empties. (:meth:`tasks.gateway.admission_queue.AdmissionQueue.cap_for` applies it.)

Lines are kept per key (a model and class), at most ``max_keys``, the least lately seen dropped first. With
another threshold (what :meth:`StandingQueue.observe` is given as ``queued``) it tells how long a line has been
deeper than that (:meth:`StandingQueue.busy_for`): admission's margin for the batches running depends on it.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable


class StandingQueue:
    """Whether each line is a standing queue (:meth:`standing`), from what it held at each look
    (:meth:`observe`). The caller caps a standing line at what the fleet answers in ``target_s``."""

    def __init__(self, interval_s: float, target_s: float, clock: Callable[[], float], max_keys: int = 256) -> None:
        self.interval_s = interval_s
        self.target_s = target_s
        self.clock = clock
        self.max_keys = max(1, max_keys)
        self._busy_since: dict[Hashable, float | None] = {}  # since when the line has not emptied (None: empty)

    def observe(self, key: Hashable, queued: float) -> None:
        """The line of ``key`` holds ``queued`` items beyond one batch per worker (<= 0: it is empty)."""
        since = self._busy_since.pop(key, None)
        if queued <= 0:
            since = None
        elif since is None:
            since = self.clock()
        self._busy_since[key] = since  # the most lately seen last
        while len(self._busy_since) > self.max_keys:
            del self._busy_since[next(iter(self._busy_since))]

    def standing(self, key: Hashable) -> bool:
        """Whether the line of ``key`` has not emptied for ``interval_s`` (0: never standing)."""
        since = self._busy_since.get(key)
        return self.interval_s > 0 and since is not None and self.clock() - since >= self.interval_s

    def busy_for(self, key: Hashable) -> float:
        """Seconds the line of ``key`` has been past the caller's threshold (``queued`` > 0 at every look since;
        0.0: it is not, or was not seen)."""
        since = self._busy_since.get(key)
        return 0.0 if since is None else max(0.0, self.clock() - since)

    def keep_only(self, keep: Callable[[Hashable], bool]) -> None:
        """Drop the lines whose key ``keep`` refuses (their model is no longer served)."""
        self._busy_since = {key: since for key, since in self._busy_since.items() if keep(key)}

    def __len__(self) -> int:
        return len(self._busy_since)
