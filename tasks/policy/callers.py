"""Who is sending an API process its requests right now: the light callers a shedding door lets through.

When an API process falls behind (a burst: thousands of connections ahead in its queue), the door refuses what
it cannot serve in time. Refusing in arrival order would refuse everyone who happens to arrive during the
burst, the steady caller with a request a second as surely as the flood that caused it. This counts each
caller's requests over the last five to six seconds (one-second buckets), so the door can still let in a
caller sending well under an even share of them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

WINDOW_S = 5  # whole seconds of history beside the current one
LIGHT_FRACTION = 0.5  # a caller is light below this fraction of an even share of the recent requests


class RecentCallers:
    """Requests per caller over the last :data:`WINDOW_S` whole seconds and the current one, in one-second
    buckets. The window outlasts a burst's arrival by a few seconds: while the process drains the backlog a
    flood left behind, the flood's caller still counts, and a steady caller is still light beside it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._second = int(clock())
        self._buckets: deque[dict[str, int]] = deque([{}], maxlen=WINDOW_S + 1)  # newest last

    def _roll(self) -> None:
        second = int(self.clock())
        if second != self._second:
            for _ in range(min(second - self._second, WINDOW_S + 1)):
                self._buckets.append({})
            self._second = second

    def arrived(self, caller: str) -> None:
        self._roll()
        now = self._buckets[-1]
        now[caller] = now.get(caller, 0) + 1

    def recent(self, caller: str) -> int:
        """The requests ``caller`` sent over the window."""
        self._roll()
        return sum(bucket.get(caller, 0) for bucket in self._buckets)

    def light(self, caller: str) -> bool:
        """Whether ``caller`` sent well under an even share of the recent requests (several callers needed)."""
        self._roll()
        callers = set().union(*self._buckets)
        if len(callers) < 2:
            return False
        total = sum(sum(bucket.values()) for bucket in self._buckets)
        return self.recent(caller) < LIGHT_FRACTION * total / len(callers)
