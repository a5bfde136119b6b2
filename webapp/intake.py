"""The pace at which an API process takes in new requests: at most ``per_tick`` start being parsed per tick.

gevent runs what is ready in turn. When a burst's bytes arrive, thousands of connections become readable in one
turn of the event loop, and each greenlet then runs its request's intake (gunicorn's parser, the door, Flask,
authentication, the body) to the point where it waits, about half a millisecond each, before the loop looks
at its sockets again. A round trip the process already has in flight (the admission round of the calls taken
in before, its broker confirm, the results coming back) waits for all of them: measured, 3,000 calls into two
processes, the first admission round's answer from Redis was seen 0.75 s late, and the device sat idle while
the callers' deadlines ran.

Here a request takes a token before its intake. Tokens come back ``per_tick`` at a time every ``tick_s``, so
the loop gets back to its sockets at least once a tick whatever the backlog, and requests are taken in in the
order they arrived (the semaphore's waiters are served first come, first served). The rate is well above what
a process can take in anyway (1,600 a second by default), so when the process is not behind nobody waits; when
it is, the wait counts towards the door's delay (:class:`webapp.door.Door`): a request that would wait longer
than the door allows (the line ahead of it at the rate measured while behind) is refused from its bytes when
it arrives, without a parse, and so is one whose turn came too late.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import gevent
from gevent.lock import Semaphore

PER_TICK = 16
TICK_S = 0.01
RATE_WEIGHT = 0.3  # each tick spent behind moves the measured intake rate this much


class Intake:
    """A token bucket of ``per_tick`` tokens, refilled every ``tick_s`` while any were taken (no timer runs
    while the process is idle). For greenlets of one gevent hub."""

    def __init__(self, per_tick: int = PER_TICK, tick_s: float = TICK_S) -> None:
        self.per_tick = per_tick
        self.tick_s = tick_s
        self._tokens = Semaphore(per_tick)
        self._refilling = False
        self._since: OrderedDict[object, float] = OrderedDict()  # when each waiting request began to wait
        self.rate = per_tick / tick_s  # requests a second taken in while behind (measured; at first the bound)
        self._refilled_at = 0.0

    def take(self) -> float | None:
        """Wait for a token (at once unless ``per_tick`` requests started in this tick already); how long it
        waited in line, None when it did not."""
        waited = None
        if self._since or not self._tokens.acquire(blocking=False):  # behind others: in line after them
            ticket, began = object(), time.monotonic()
            self._since[ticket] = began
            try:
                self._tokens.acquire()
            finally:
                del self._since[ticket]
            waited = time.monotonic() - began
        if not self._refilling:
            self._refilling, self._refilled_at = True, time.monotonic()
            gevent.spawn_later(self.tick_s, self._refill)
        return waited

    def give_back(self) -> None:
        """Return the token of a request refused at its turn (a few header lookups and one write): the next in
        line need not wait a tick for it."""
        if self._tokens.counter < self.per_tick:
            self._tokens.release()

    @property
    def waiting(self) -> int:
        """Requests waiting for a token now."""
        return len(self._since)

    def expected_wait_s(self) -> float:
        """How long a request arriving now would wait for its turn: those in line at the measured rate, or the
        time the first in line has waited so far, whichever is longer (0 when none waits)."""
        oldest = next(iter(self._since.values()), None)
        if oldest is None:
            return 0.0
        return max(len(self._since) / self.rate, time.monotonic() - oldest)

    def _refill(self) -> None:
        now = time.monotonic()
        missing = self.per_tick - self._tokens.counter
        if self._since and missing == self.per_tick and now > self._refilled_at:  # a tick spent behind
            sample = missing / (now - self._refilled_at)
            self.rate += RATE_WEIGHT * (sample - self.rate)
        self._refilled_at = now
        for _ in range(missing):
            self._tokens.release()
        if missing:
            gevent.spawn_later(self.tick_s, self._refill)
        else:
            self._refilling = False

