"""Who is sending an API process its requests right now: the light callers a shedding door lets through.

When an API process falls behind (a burst: thousands of connections ahead in its queue), the door refuses what
it cannot serve in time. Refusing in arrival order would refuse everyone who happens to arrive during the
burst, the steady caller with a request a second as surely as the flood that caused it. This counts each
caller's requests over the last one to two seconds (two one-second buckets), so the door can still let in a
caller sending well under an even share of them.
"""
from __future__ import annotations

from collections.abc import Callable

LIGHT_FRACTION = 0.5  # a caller is light below this fraction of an even share of the recent requests


class RecentCallers:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._second = int(clock())
        self._now: dict[str, int] = {}
        self._before: dict[str, int] = {}
        self._total_now = self._total_before = 0

    def _roll(self) -> None:
        second = int(self.clock())
        if second != self._second:
            if second == self._second + 1:
                self._before, self._total_before = self._now, self._total_now
            else:
                self._before, self._total_before = {}, 0
            self._now, self._total_now, self._second = {}, 0, second

    def arrived(self, caller: str) -> None:
        self._roll()
        self._now[caller] = self._now.get(caller, 0) + 1
        self._total_now += 1

    def recent(self, caller: str) -> int:
        """The requests ``caller`` sent over the last one to two seconds."""
        self._roll()
        return self._now.get(caller, 0) + self._before.get(caller, 0)

    def light(self, caller: str) -> bool:
        """Whether ``caller`` sent well under an even share of the recent requests (several callers needed)."""
        self._roll()
        callers = len(self._now.keys() | self._before.keys())
        if callers < 2:
            return False
        return self.recent(caller) < LIGHT_FRACTION * (self._total_now + self._total_before) / callers
