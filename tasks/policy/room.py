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

A request's turn comes once the requests this process let in before it are through admission, at the pace it takes
them through while requests wait (:meth:`Room.pace`, measured over the last second). A request whose place is beyond
what the fleet can answer within its deadline (the same cap the admission script applies, reckoned at the request's
turn: :meth:`tasks.gateway.admission_queue.AdmissionQueue.place`), or whose turn would come past the door's bound,
is refused at once; the others go on, in arrival order, to the admission script, which stays the judge. A request
let in wrongly gets the script's own refusal, but only at its turn; one refused wrongly loses an answer. A request
let in that never reaches admission (a 400, a client gone) stops counting after ``pending_ttl_s``. Requests are not
told apart: any request through admission (one that went the usual way, a light caller's) takes the oldest let in
off its line, so the count is about right under a flood, where nearly every request was let in here.

Lines are kept only for the models the fleet serves (the gateway refuses any other before it reaches here), at
most ``max_lines`` of them: a line with nothing pending and nothing left of its count goes first, then the one
least lately used; :meth:`Room.keep_only` drops the lines of models no longer served.
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
MAX_LINES = 256  # lines kept at most (models x classes)


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

    def __init__(self, processes: int, pending_ttl_s: float, clock: Callable[[], float],
                 max_lines: int = MAX_LINES) -> None:
        self.processes = max(1, processes)
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self.max_lines = max(1, max_lines)
        self._lines: dict[Hashable, _Line] = {}  # least lately used first
        self._paced: deque[float] = deque()  # when each recent request got through while others let in waited
        self._paced_since: float | None = None  # when the requests in ``_paced`` began coming without a gap

    def place(self, key: Hashable) -> float:
        """Items ahead of a request of ``key`` arriving now (0 when nothing is known of its line)."""
        line = self._lines.get(key)
        if line is None:
            return 0.0
        self._expire(line, self.clock())
        return self.counted(key) + self.processes * len(line.pending)

    def counted(self, key: Hashable) -> float:
        """Items of ``key``'s model in flight as the last verdict counted them, less what the fleet has answered
        since (the requests let in here and not through admission yet are not among them)."""
        line = self._lines.get(key)
        if line is None:
            return 0.0
        return max(0.0, line.count - line.rate * (self.clock() - line.seen_at))

    def waiting(self) -> int:
        """Requests of every line this process has let in that are not through admission yet: all of them go
        through it before a request arriving now."""
        now = self.clock()
        for line in self._lines.values():
            self._expire(line, now)
        return sum(len(line.pending) for line in self._lines.values())

    def pace(self, starting: float = 0.0) -> float | None:
        """Requests a second this process takes through admission while requests it let in wait for their turn,
        over the last ``PACE_WINDOW_S`` (None: too few to tell).

        Not the gate's drain rate (its slots over the mean time in one): logged under a 5,000-call flood, that
        read 5,000-23,000 a second while the process was idle and 215 a second as the flood landed, while the
        verdicts came at 450-1,200 a second. A stall shows here too: the span runs on to now.

        ``starting``: the least it reads in the first window of a busy spell. A burst's first admission rounds
        each wait for the process's connections and turns to be set up (traced: 180 calls a second for the first
        second of a 3,000-call burst, 640-940 after); read as the pace, it refused at the door, as too late for
        their turn, calls that were admitted in time after all, and the device went idle before their deadlines."""
        now = self.clock()
        self._trim_paced(now)
        if len(self._paced) < PACE_MIN_CALLS:
            return None
        measured = len(self._paced) / max(now - self._paced[0], 1e-3)
        if self._paced_since is not None and now - self._paced_since < PACE_WINDOW_S:
            return max(measured, starting)
        return measured

    def let_in(self, key: Hashable) -> None:
        """A request of ``key`` goes on to admission: it counts ahead of the next until it is through."""
        self._line(key).pending.append(self.clock())

    def decided(self, key: Hashable, count: int, rate: float) -> None:
        """An admission verdict for a request of ``key``: the model counted ``count`` items (with the request, when
        it was admitted), and the fleet answers ``rate`` items a second."""
        line = self._line(key)
        line.count, line.seen_at, line.rate = count, self.clock(), rate

    def ended(self, key: Hashable) -> None:
        """A request of ``key`` is through admission, whatever came of it (admitted, refused, or failed: a Redis
        outage's 503s must not stand in the line for ``pending_ttl_s`` and make the next calls look late). The
        oldest request let in stops counting as pending (they go through in about the order they came)."""
        now = self.clock()
        line = self._lines.get(key)
        if line is not None and line.pending:
            line.pending.popleft()
        if any(other.pending for other in self._lines.values()):
            self._trim_paced(now)  # kept to the window even while nothing asks for the pace
            if not self._paced:
                self._paced_since = now
            self._paced.append(now)

    def keep_only(self, keep: Callable[[Hashable], bool]) -> None:
        """Drop the lines whose key ``keep`` refuses (their model is no longer served)."""
        self._lines = {key: line for key, line in self._lines.items() if keep(key)}

    def __len__(self) -> int:
        return len(self._lines)

    def _line(self, key: Hashable) -> _Line:
        """The line of ``key``, made the most lately used; a new one past ``max_lines`` evicts an idle line, or
        else the least lately used."""
        line = self._lines.pop(key, None)
        if line is None:
            line = _Line()
            if len(self._lines) >= self.max_lines:
                now = self.clock()
                idle = next((k for k, other in self._lines.items() if self._idle(other, now)), None)
                del self._lines[idle if idle is not None else next(iter(self._lines))]
        self._lines[key] = line
        return line

    def _idle(self, line: _Line, now: float) -> bool:
        """Nothing pending and the last count drained: the line tells nothing a new one would not."""
        self._expire(line, now)
        return not line.pending and line.count - line.rate * (now - line.seen_at) <= 0

    def _trim_paced(self, now: float) -> None:
        while self._paced and now - self._paced[0] > PACE_WINDOW_S:
            self._paced.popleft()

    def _expire(self, line: _Line, now: float) -> None:
        while line.pending and now - line.pending[0] > self.pending_ttl_s:
            line.pending.popleft()
