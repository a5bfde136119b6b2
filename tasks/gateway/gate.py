"""The turnstile in front of admission: how many calls one API process takes through admission and publishing
at once, the rest waiting their turn in arrival order.

Admitting a call is a few round trips (Redis, then RabbitMQ's confirm); at each the process runs whatever else is
ready. With no limit, a process short of CPU starts every call it has accepted, and each of them then waits
behind all the others at every round trip: under a burst every caller is late together, including the ones
that were admitted. With a limit, the calls inside finish their admission quickly, and the queue of the
others is visible: a call that has waited longer than ``max_wait_s`` for its turn is refused (429
overloaded) while its caller can still be told fast, rather than admitted to be answered after its deadline.

``Retry-After`` on that refusal is the queue ahead divided by the drain rate: the slots over the mean time a
call holds one (the capacity of the admission path as measured now, under whatever CPU it gets). The same
figure lets the door (:mod:`webapp.door`) refuse, before Flask reads the request, a call that could not get its
turn in time anyway: under a flood the refusals then cost a small part of what an admission does.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tasks.errors import Overloaded
from tasks.policy.callers import RecentCallers

HOLD_WEIGHT = 0.05  # each call's time in its slot moves the mean this much


class Gate:
    """At most ``slots`` calls pass at once; the rest wait (first come, first served) up to ``max_wait_s`` for
    their turn. Threads or greenlets alike: the lock and semaphore are gevent's once gunicorn's worker has
    monkey-patched threading.

    ``callers``: who sends the process its calls now, as its door counts them (every arrival, the refused
    among them), to tell a light tenant by. Counted at the gate instead (None: a process no door stands in
    front of, llmb-jobs), a flood the door turns away would not count, and its few calls let through would make
    the steady tenant beside it look heavy: measured, a steady tenant's calls waited 0.18-0.48 s for a slot
    while the door judged them light."""

    def __init__(self, slots: int, max_wait_s: float, clock: Callable[[], float] = time.monotonic,
                 callers: RecentCallers | None = None) -> None:
        self.slots = slots
        self.max_wait_s = max_wait_s
        self.clock = clock
        self._free = threading.Semaphore(slots)
        self._lock = threading.Lock()
        self.hold_s = 0.0  # mean time a call holds its slot (exponentially weighted)
        self._since: OrderedDict[object, float] = OrderedDict()  # when each waiting call started waiting, oldest first
        self._counts = callers is None  # no door counts the calls: the gate does, as they pass
        self.callers = RecentCallers(clock) if callers is None else callers  # whose calls come now, by tenant

    @contextmanager
    def passage(self, caller: str = "") -> Iterator[Turn]:
        """Hold a slot for the block (or until its :meth:`Turn.leave`): wait for one up to ``max_wait_s``, or
        raise Overloaded. (The door has already refused, by the expected wait, the calls of heavy callers that
        would not get their turn in time; the calls it let in wait their turn here.)

        A light ``caller`` (a tenant sending well under an even share of the recent calls) passes at once, beside
        the slots: behind a flood's queue a steady tenant's call would otherwise wait out ``max_wait_s`` with
        the flood's. Light callers are a small share of the calls by definition, so the slots still bound the
        admission work."""
        if self._counts:
            self.callers.arrived(caller)
        if caller and self.callers.light(caller):
            yield NO_GATE
            return
        started, ticket = self.clock(), object()
        with self._lock:
            self._since[ticket] = started
        try:
            got = self._free.acquire(timeout=self.max_wait_s)
        finally:
            with self._lock:
                del self._since[ticket]
        if not got:
            waited = self.clock() - started
            raise Overloaded(f"this API process kept the request waiting {waited * 1000:.0f} ms for its turn at "
                             "admission (more calls than it can admit in time); retry shortly",
                             retry_after_s=self.retry_after_s())
        turn = Turn(self, self.clock())
        try:
            yield turn
        finally:
            turn.leave()

    def _left(self, entered: float) -> None:
        self._free.release()
        held = self.clock() - entered
        with self._lock:
            self.hold_s = held if self.hold_s == 0 else self.hold_s + HOLD_WEIGHT * (held - self.hold_s)

    @property
    def waiting(self) -> int:
        """Calls waiting for their turn now."""
        return len(self._since)

    def drain_rate(self) -> float:
        """Calls per second the slots pass while they are all busy: slots over the mean time in one."""
        return self.slots / self.hold_s if self.hold_s > 0 else math.inf

    def expected_wait_s(self) -> float:
        """How long a call arriving now would wait for its turn: the calls waiting, at the drain rate, or the
        time the oldest of them has waited so far, whichever is longer (the mean lags behind a sudden slow-down;
        the oldest call's wait does not)."""
        with self._lock:
            waiting = len(self._since)
            oldest = next(iter(self._since.values()), None)
        if not waiting:
            return 0.0
        return max(waiting / self.drain_rate(), 0.0 if oldest is None else self.clock() - oldest)

    def retry_after_s(self) -> int:
        """Seconds until the calls waiting now would have passed (at least 1)."""
        return max(1, math.ceil(self.expected_wait_s()))


class Turn:
    """A call's slot at the gate; :meth:`leave` gives it up early (before waiting on the broker's confirm, which
    takes no CPU and, under a broker alarm, seconds)."""

    def __init__(self, gate: Gate | None = None, entered: float = 0.0) -> None:
        self._gate, self._entered = gate, entered

    def leave(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._left(self._entered)


NO_GATE = Turn()  # the turn of a call in a process without a gate: nothing to leave
