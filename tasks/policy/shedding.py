"""Load shedding at an API process's front door: how many inference requests it holds, and which it refuses for
being too late (pure: the clock, the line at admission and the process's own backlog are injected).

The admission caps (``LLMB_ADMISSION_CAP`` + ``LLMB_OFFLINE_ADMISSION_CAP``) are kept in Redis across every API
process; each process serves its share of them. A process already holding its share cannot admit more anyway,
so it refuses the next at once (429 queue_full with Retry-After) from this counter: before the body is read,
before Redis or the database is asked, so that a refusal costs far less than an admission.

A request the process gets to late (from its bytes' arrival to its handler, plus the wait expected for its
turn at admission, more than ``LLMB_DOOR_MAX_DELAY_MS``) is refused with 429 overloaded: the calls at the head of
a burst's line can still be answered in time, the ones behind them cannot.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tasks.errors import Overloaded, QueueFull
from tasks.policy.callers import RecentCallers


class Turnstile(Protocol):
    """The line for admission a request joins after the door (:class:`tasks.gateway.gate.Gate`)."""

    def expected_wait_s(self) -> float: ...

    def retry_after_s(self) -> int: ...


@dataclass(frozen=True)
class Lateness:
    """How late a request is, against the bound that applies now."""

    behind: bool  # refused unless its caller is light: late, or could not get its turn in time
    late: bool  # waited longer than the bound for this process to get to it
    wait_s: float  # the wait expected for its turn at admission


class Door:
    """Counts the requests this process holds; :meth:`enter` refuses beyond ``limit``, and refuses any request
    the process got to more than ``max_delay_s`` after it arrived.

    The delay is the process's own queue: under a burst, thousands of connections wait for the CPU between
    their accept and their handler. Admitting them anyway would let every admitted caller be answered late
    (the answers queue behind the same CPU); refusing the late ones at this point costs a fraction of an
    admission and lets the queue drain."""

    def __init__(self, limit: int, retry_after_s: int, max_delay_s: float = float("inf"),
                 clock: Callable[[], float] | None = None, gate: Turnstile | None = None,
                 backlog: Callable[[], tuple[int, float]] = lambda: (0, 0.0),
                 callers: RecentCallers | None = None) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.max_delay_s = max_delay_s
        self.clock = clock or time.monotonic  # tests inject theirs
        self.gate = gate  # the process's turnstile in front of admission: a request that would wait too long is refused
        self.backlog = backlog  # (connections waiting for the process, how long the oldest has waited)
        self.held = 0
        self.last_delay_s = 0.0  # how long the last request entering waited for this process to get to it
        # who sends what: counted here (and read by the gate, when it is given the gate's count)
        self.callers = RecentCallers(self.clock) if callers is None else callers
        self._lock = threading.Lock()  # gevent's own lock once gunicorn's worker has monkey-patched threading

    def enter(self, arrived_at: float | None = None, caller: str = "",
              identify: Callable[[], str] | None = None, in_line: bool = False) -> None:
        """Count one more request held, or raise QueueFull (nothing counted) when the process holds its share,
        or Overloaded when the request waited longer than the bound for this process to get to it, or would
        wait too long for its turn at admission.

        ``caller`` says who sends it (its API key or X-Tenant header); when it is empty and the request is about
        to be refused, ``identify`` may name it (the tenant in its body). A caller sending well under an even
        share of this process's recent requests is let in late all the same: a burst from one caller must not
        get the others refused.

        ``in_line``: the request was let in on arrival by its place in its model's line, its turn at admission
        reckoned then at the pace the process takes calls through (:meth:`AdmissionQueue.place`). Only lateness
        refuses it here, not the gate's expected wait: that estimate (slots over the mean time in one) reads a
        burst's first admission rounds, each held up by the burst's arrivals, as the process's pace, and refused
        calls the fleet had room for (112-604 of a 3,000-call burst, while the device went idle before the last
        deadline)."""
        delay = self.last_delay_s = 0.0 if arrived_at is None else self.clock() - arrived_at
        error = self._behind(delay, caller, identify, late_only=in_line)
        if error is not None:
            raise error
        with self._lock:
            if self.held >= self.limit:
                raise QueueFull(f"this API process holds {self.held} requests, its share of the admission caps; "
                                f"retry in {self.retry_after_s} s", retry_after_s=self.retry_after_s)
            self.held += 1

    def leave(self) -> None:
        with self._lock:
            self.held -= 1

    def behind_at_accept(self, delay: float | None = None) -> bool:
        """Whether a request accepted now would be refused for want of time: by its ``delay`` so far, or (None) by
        the delay expected of a request arriving now (see :meth:`_expected_delay`)."""
        return self.lateness(self._expected_delay() if delay is None else delay).behind

    def refusal_at_accept(self, caller: str, delay: float | None = None) -> Overloaded | None:
        """The refusal of a request just accepted (see :meth:`behind_at_accept`) unless its caller is light (None:
        let it in). A caller let in here is counted again when its request reaches :meth:`enter`: while the
        process is behind, a light caller looks up to twice as busy as it is (still light unless near the line)."""
        delay = self._expected_delay() if delay is None else delay
        if not self.lateness(delay).behind or self.callers.light(caller):
            return None
        return self._behind(delay, caller, None)

    def lateness(self, delay: float) -> Lateness:
        """How late a request ``delay`` behind is: late when it waited more than ``max_delay_s``, behind when
        also it could not get its turn in time."""
        wait = self.gate.expected_wait_s() if self.gate is not None else 0.0
        late = delay > self.max_delay_s
        return Lateness(behind=late or wait > self.max_delay_s - delay, late=late, wait_s=wait)

    def _expected_delay(self) -> float:
        """How long a request accepted now will wait for this process to get to it: while connections are still
        waiting for it (``backlog``), as long as the last request it got to waited, or the oldest of them so
        far if longer; nothing once none wait (the requests let in then measure it again)."""
        waiting, oldest_s = self.backlog()
        return max(oldest_s, self.last_delay_s) if waiting else 0.0

    def _behind(self, delay: float, caller: str, identify: Callable[[], str] | None,
                late_only: bool = False) -> Overloaded | None:
        """Overloaded when a request ``delay`` behind could not get its turn in time (``late_only``: when it is
        late), unless its caller is light (the caller is counted either way)."""
        lateness = self.lateness(delay)
        if late_only:
            lateness = Lateness(behind=lateness.late, late=lateness.late, wait_s=lateness.wait_s)
        if lateness.behind and not caller and identify is not None:
            caller = identify()
        self.callers.arrived(caller)
        if not lateness.behind or self.callers.light(caller):
            return None
        if lateness.late:
            return Overloaded(f"this API process is running {delay * 1000:.0f} ms behind (a burst); retry in "
                              f"{self.retry_after_s} s", retry_after_s=self.retry_after_s)
        assert self.gate is not None
        return too_slow(delay + lateness.wait_s, self.gate.retry_after_s())


def too_slow(turn_s: float, retry_after_s: int) -> Overloaded:
    """The refusal of a request whose turn at admission would come ``turn_s`` after its arrival, past the door's
    bound."""
    return Overloaded(f"this API process would take {turn_s * 1000:.0f} ms to get to the request (more calls "
                      f"than it can admit in time); retry in {retry_after_s} s", retry_after_s=retry_after_s)
