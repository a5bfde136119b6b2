"""Where a request arriving now would stand in the fleet's line for its model, judged without asking Redis (pure:
the clock is injected).

Under a burst thousands of requests reach an API process within a fraction of a second, and each costs about a
millisecond of CPU to admit. Asking Redis for each one's place (the admission script) means taking every one in,
in arrival order, at the pace the CPU allows: the last of a 3,000-call burst learnt it was refused 2-3 s after
sending it, though the fleet had been full for most of that time. Here the process keeps its own view of each
model's line, so a request can be placed the moment its bytes arrive:

* the count the last admission verdict saw (the script's ``ok:<n>`` or ``full:<n>``), less what the fleet has
  answered since at its measured rate;
* plus the requests this process has let in that are not through admission yet, times the API processes that
  share the load (the others are taking in their part of the same burst, unseen until the next verdict).

A request's turn comes once the requests this process let in before it are through admission, at the pace it
takes them through while requests wait (:meth:`Room.pace`, measured over the last second). A request whose place is
beyond what the fleet can answer within its deadline (the same cap the admission script applies, reckoned at
the request's turn: :meth:`tasks.gateway.gateway.Gateway.place`), or whose turn would come past the door's bound,
is refused at once;
the others go on, in arrival order, to the admission script, which stays the judge. A request let in wrongly
gets the script's own refusal, but only at its turn; one refused wrongly loses an answer. A request let in that
never reaches admission (a 400, a client gone) stops counting after ``pending_ttl_s``. Requests are not told
apart: any request through admission (one that went the usual way, a light caller's) takes the oldest let in
off its line, so the count is about right under a flood, where nearly every request was let in here.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import Enum


class Placed(Enum):
    """A request the view of its line did not refuse."""

    IN_LINE = "in_line"  # let in, and counted ahead of the next until it is through admission
    UNKNOWN = "unknown"  # nothing known to judge it by (no live worker of its model seen yet): the usual way


PACE_WINDOW_S = 1.0  # the pace of requests through admission is measured over this long...
PACE_MIN_CALLS = 16  # ... from at least this many (fewer: not known)


@dataclass
class _Line:
    count: int = 0  # the model's items counted by the last verdict
    seen_at: float = 0.0  # when
    rate: float = 0.0  # items per second the fleet answers (its measured throughput then)
    pending: deque[float] = field(default_factory=deque)  # when each request let in, not yet through, arrived


class Room:
    """Each model's (and class's) line as this process sees it: :meth:`place` of a request arriving now, against
    which the door compares the deadline cap, and :meth:`waiting` / :meth:`pace` for when its turn comes;
    :meth:`let_in`, :meth:`decided` and :meth:`ended` keep it up to date."""

    def __init__(self, processes: int, pending_ttl_s: float, clock: Callable[[], float]) -> None:
        self.processes = max(1, processes)
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self._lines: dict[Hashable, _Line] = {}
        self._paced: deque[float] = deque()  # when each recent request got through while others let in waited

    def place(self, key: Hashable) -> float:
        """Items ahead of a request of ``key`` arriving now (0 when nothing is known of its line)."""
        line = self._lines.get(key)
        if line is None:
            return 0.0
        now = self.clock()
        self._expire(line, now)
        drained = max(0.0, line.count - line.rate * (now - line.seen_at))
        return drained + self.processes * len(line.pending)

    def waiting(self) -> int:
        """Requests of every line this process has let in that are not through admission yet: all of them go
        through it before a request arriving now."""
        now = self.clock()
        for line in self._lines.values():
            self._expire(line, now)
        return sum(len(line.pending) for line in self._lines.values())

    def pace(self) -> float | None:
        """Requests a second this process takes through admission while requests it let in wait for their turn,
        over the last ``PACE_WINDOW_S`` (None: too few to tell).

        Not the gate's drain rate (its slots over the mean time in one): logged under a 5,000-call flood, that
        read 5,000-23,000 a second while the process was idle and 215 a second as the flood landed, while the
        verdicts came at 450-1,200 a second. A stall shows here too: the span runs on to now."""
        now = self.clock()
        while self._paced and now - self._paced[0] > PACE_WINDOW_S:
            self._paced.popleft()
        if len(self._paced) < PACE_MIN_CALLS:
            return None
        return len(self._paced) / max(now - self._paced[0], 1e-3)

    def let_in(self, key: Hashable) -> None:
        """A request of ``key`` goes on to admission: it counts ahead of the next until it is through."""
        self._lines.setdefault(key, _Line()).pending.append(self.clock())

    def decided(self, key: Hashable, count: int, rate: float) -> None:
        """An admission verdict for a request of ``key``: the model counted ``count`` items (with the request, when
        it was admitted), and the fleet answers ``rate`` items a second."""
        line = self._lines.setdefault(key, _Line())
        line.count, line.seen_at, line.rate = count, self.clock(), rate

    def ended(self, key: Hashable) -> None:
        """A request of ``key`` is through admission, whatever came of it (admitted, refused, or failed: a Redis
        outage's 503s must not stand in the line for ``pending_ttl_s`` and make the next calls look late). The
        oldest request let in stops counting as pending (they go through in about the order they came)."""
        now = self.clock()
        line = self._lines.setdefault(key, _Line())
        if line.pending:
            line.pending.popleft()
        if any(other.pending for other in self._lines.values()):
            self._paced.append(now)

    def _expire(self, line: _Line, now: float) -> None:
        while line.pending and now - line.pending[0] > self.pending_ttl_s:
            line.pending.popleft()
