"""How fast a batch job's lines are fed into the system, and what to do with each answer (pure: the clock is passed
in, nothing is read or written).

A job's lines go through the same door as every other request, at offline priority, so they should take the room
interactive traffic leaves and no more. :class:`FeedControl` keeps a window of lines in flight, as TCP keeps a
congestion window:

- it starts small (``initial``) and grows by one line per answer (doubling every round trip) until the first sign
  of a full system, then by about one line per round trip;
- it grows only while answers come back promptly: a line that took more than ``slack`` times the fastest answer
  of the last ``base_period_s`` or two means lines now queue behind one another (more in flight would only wait
  longer), so it holds;
- a refusal for want of room (``queue_full``, ``tenant_over_limit``, ``overloaded``: a 429) halves it and pauses
  the job for the Retry-After the refusal gave; an outage (``unavailable``) or a failure of the pipeline halves it
  and pauses for an exponential backoff (0.5 s,
  1 s, 2 s, ... up to ``max_backoff_s``), reset by the next answer. The lines sent together before a cut are
  answered together, so their refusals count as one signal: only a line sent after the last cut cuts again.

:func:`disposition` says what an answer means for its line, from its error type alone: final (written to the
output or error file), or sent again (and after how many tries a line stops being sent and its last error becomes
final). :func:`pick_jobs` says
which waiting job a free slot of ``llmb-jobs`` takes: the next of the tenant running fewest.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tasks.errors import (
    BatchingError,
    DeadlineExceeded,
    ModelNotFound,
    Overloaded,
    QueueFull,
    TenantOverLimit,
    Unavailable,
)

MAX_LINE_ATTEMPTS = 8  # tries of a line that keeps failing in a way that may be the line's own fault


class Disposition(StrEnum):
    """What an answer means for its line."""

    FINAL = "final"  # an output, or an error the line itself caused (invalid, forbidden, poison...): write it
    REFUSED = "refused"  # no room now: send it again after Retry-After, with fewer lines in flight
    UNAVAILABLE = "unavailable"  # the pipeline unreachable: back off and send it again, however often
    RETRY = "retry"  # late, an unexpected failure, the model not served (yet): again, at most MAX_LINE_ATTEMPTS


REFUSALS = (QueueFull.type, TenantOverLimit.type, Overloaded.type)
RETRIED = (DeadlineExceeded.type, ModelNotFound.type, BatchingError.type)
# retries_exhausted is not among the outages: the line itself killed its workers
OUTAGES = (Unavailable.type,)


def disposition(error_type: str | None) -> Disposition:
    """The disposition of one answer, from its error type (None: it succeeded)."""
    if error_type in REFUSALS:
        return Disposition.REFUSED
    if error_type in RETRIED:
        return Disposition.RETRY
    if error_type in OUTAGES:
        return Disposition.UNAVAILABLE
    return Disposition.FINAL


def gives_up(d: Disposition, attempts: int, max_attempts: int = MAX_LINE_ATTEMPTS) -> bool:
    """Whether a line answered ``d`` after ``attempts`` tries (this one included) is given up: its error is final.
    Refusals and outages are the system's state, not the line's fault: those lines wait (until the job expires)."""
    return d is Disposition.FINAL or (d is Disposition.RETRY and attempts >= max_attempts)


@dataclass
class FeedControl:
    """The window of one job's lines in flight, and when the job may send again."""

    initial: int = 100
    ceiling: int = 1000
    floor: int = 1
    slack: float = 3.0  # an answer within slack x the fastest one is prompt (a pipeline ~3 batches deep)
    base_period_s: float = 30.0  # the fastest answer is the fastest of the last one or two such periods
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    window: float = field(init=False)
    slow_start: bool = field(init=False, default=True)
    resume_at: float = field(init=False, default=float("-inf"))  # nothing is sent before this time
    base_s: float | None = field(init=False, default=None)  # the fastest answer of the last period or two
    _fastest: tuple[float, float, float] = field(init=False, default=(float("-inf"), float("inf"), float("inf")))
    failures: int = field(init=False, default=0)  # outages in a row, for the backoff
    cut_at: float = field(init=False, default=float("-inf"))  # the last decrease

    def __post_init__(self) -> None:
        self.floor = max(1, self.floor)
        self.ceiling = max(self.floor, self.ceiling)
        self.window = float(min(max(self.initial, self.floor), self.ceiling))

    def room(self, in_flight: int, now: float) -> int:
        """How many more lines may be sent now."""
        if now < self.resume_at:
            return 0
        return max(0, int(self.window) - in_flight)

    def wait_s(self, now: float) -> float:
        """How long until the job may send again (0: now)."""
        return max(0.0, self.resume_at - now)

    def answered(self, latency_s: float | None, now: float) -> None:
        """A line was answered (an output or a final error of its own) ``latency_s`` after it was sent; None for
        an answer that says nothing of the fleet's speed (an error at the door, a replayed answer)."""
        self.failures = 0
        if latency_s is None:
            return
        started, previous, current = self._fastest
        if now - started >= self.base_period_s:  # a new period: forget the one before last (a fleet may slow down)
            started, previous, current = now, current, float("inf")
        current = min(current, latency_s)
        self._fastest = (started, previous, current)
        self.base_s = min(previous, current)
        if latency_s > self.slack * self.base_s:  # lines queue behind each other: more would only wait longer
            self.slow_start = False
            return
        self.window += 1.0 if self.slow_start else 1.0 / self.window
        self.window = min(self.window, float(self.ceiling))

    def refused(self, sent_at: float, retry_after_s: float | None, now: float) -> None:
        """A line sent at ``sent_at`` was refused for want of room (429): halve, pause for Retry-After."""
        if self._cut(sent_at, now):
            self.resume_at = max(self.resume_at, now + max(0.0, retry_after_s or 0.0))

    def failed(self, sent_at: float, now: float) -> None:
        """A line sent at ``sent_at`` met an outage or a failure of the pipeline: halve, back off exponentially."""
        if self._cut(sent_at, now):
            self.failures += 1
            delay = min(self.max_backoff_s, self.first_backoff_s * 2 ** (self.failures - 1))
            self.resume_at = max(self.resume_at, now + delay)

    def _cut(self, sent_at: float, now: float) -> bool:
        """Halve the window, unless the line was sent before the last cut (part of the signal that caused it:
        a hundred lines refused together are one refusal, not a hundred)."""
        self.slow_start = False
        if sent_at < self.cut_at:
            return False
        self.window = max(float(self.floor), self.window / 2)
        self.cut_at = now
        return True


def pick_jobs(waiting: Sequence[tuple[str, str]], running: Mapping[str, int], room: int) -> list[str]:
    """Which waiting jobs to take for ``room`` free slots, in the order to take them: each next one from the
    tenant with the fewest jobs running (the ones picked here counted), a tie going to the oldest job.

    ``waiting`` is (job id, tenant) of jobs nobody runs; ids sort by creation time (oldest first). ``running`` is
    each tenant's jobs running now, in every llmb-jobs process. Taking the oldest job of all instead lets one
    tenant that submitted eight large jobs first hold every slot while the others' jobs wait behind them."""
    queues: dict[str, list[str]] = {}
    for job_id, tenant in sorted(waiting):
        queues.setdefault(tenant, []).append(job_id)
    for ids in queues.values():
        ids.reverse()  # oldest last: popped first
    counts = {tenant: running.get(tenant, 0) for tenant in queues}
    chosen: list[str] = []
    while len(chosen) < room and queues:
        tenant = min(queues, key=lambda t: (counts[t], queues[t][-1]))
        chosen.append(queues[tenant].pop())
        counts[tenant] += 1
        if not queues[tenant]:
            del queues[tenant]
    return chosen
