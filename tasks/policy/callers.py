"""Who is sending an API process its requests right now: the light callers a shedding door lets through.

When an API process falls behind (a burst: thousands of connections ahead in its queue), the door refuses what
it cannot serve in time. Refusing in arrival order would refuse everyone who happens to arrive during the
burst, the steady caller with a request a second as surely as the flood that caused it. This counts each
caller's requests over the last five to six seconds (one-second buckets), so the door can still let in a
caller sending well under an even share of them.

A caller is a tenant (the door names it: :class:`webapp.door.DoorIdentity`), and the count is kept so that no
caller can make it expensive: each arrival costs O(1) (running totals; a bucket is forgotten once, when it leaves
the window), and at most ``max_callers`` callers are told apart: beyond them, callers not yet counted share one
entry, :data:`OTHERS`, one heavy caller however many names it hides, so a flood of names neither grows the
table nor drives the light threshold towards nothing.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

WINDOW_S = 5  # whole seconds of history beside the current one
LIGHT_FRACTION = 0.5  # a caller is light below this fraction of an even share of the recent requests
MAX_CALLERS = 1024  # callers told apart in the window; the rest are counted together as OTHERS
OTHERS = "(others)"  # not a tenant name (those are letters, digits, '.', '_' and '-')


class RecentCallers:
    """Requests per caller over the last :data:`WINDOW_S` whole seconds and the current one, in one-second
    buckets. The window outlasts a burst's arrival by a few seconds: while the process drains the backlog a
    flood left behind, the flood's caller still counts, and a steady caller is still light beside it.

    Running totals (per caller and overall) make :meth:`arrived`, :meth:`recent` and :meth:`light` O(1); each
    bucket's entries are subtracted once, when it leaves the window (amortised O(1) per arrival). At most
    ``max_callers`` entries are kept: a caller arriving while the table is full is counted as :data:`OTHERS`."""

    def __init__(self, clock: Callable[[], float], max_callers: int = MAX_CALLERS) -> None:
        self.clock = clock
        self.max_callers = max(2, max_callers)
        self._second = int(clock())
        self._buckets: deque[dict[str, int]] = deque([{}])  # newest last, at most WINDOW_S + 1
        self._counts: dict[str, int] = {}  # each caller's requests over the window (only callers with some)
        self._total = 0
        self._lock = threading.Lock()  # gevent's once gunicorn's worker has monkey-patched threading

    def __len__(self) -> int:
        """The callers told apart now (at most ``max_callers``)."""
        return len(self._counts)

    def _roll(self) -> None:
        second = int(self.clock())
        if second != self._second:
            for _ in range(min(second - self._second, WINDOW_S + 1)):
                self._buckets.append({})
                if len(self._buckets) > WINDOW_S + 1:
                    self._forget(self._buckets.popleft())
            self._second = second

    def _forget(self, bucket: dict[str, int]) -> None:
        for caller, sent in bucket.items():
            left = self._counts[caller] - sent
            if left:
                self._counts[caller] = left
            else:
                del self._counts[caller]
            self._total -= sent

    def _entry(self, caller: str) -> str:
        """The entry ``caller`` is counted under: its own, unless the table is full without it."""
        if caller in self._counts or len(self._counts) < self.max_callers - (OTHERS not in self._counts):
            return caller
        return OTHERS

    def arrived(self, caller: str) -> None:
        with self._lock:
            self._roll()
            entry = self._entry(caller)
            now = self._buckets[-1]
            now[entry] = now.get(entry, 0) + 1
            self._counts[entry] = self._counts.get(entry, 0) + 1
            self._total += 1

    def recent(self, caller: str) -> int:
        """The requests ``caller`` sent over the window (those of :data:`OTHERS` if it is counted there)."""
        with self._lock:
            self._roll()
            return self._counts.get(self._entry(caller), 0)

    def light(self, caller: str) -> bool:
        """Whether ``caller`` sent well under an even share of the recent requests (several callers needed)."""
        with self._lock:
            self._roll()
            callers = len(self._counts)
            if callers < 2:
                return False
            return self._counts.get(self._entry(caller), 0) < LIGHT_FRACTION * self._total / callers
