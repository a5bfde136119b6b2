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
order they arrived, each caller's in turn (a tenant's request does not wait behind another's line). The rate
is well above what a process can take in anyway (1,600 a second by default), so when the process is not behind
nobody waits; when it is, the wait counts towards the door's delay (:class:`webapp.door.Door`): a request that
would wait longer than the door allows (the line ahead of it at the rate measured while behind) is refused from
its bytes when it arrives, without a parse, and so is one whose turn came too late.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

import gevent
from gevent.event import Event

PER_TICK = 16
TICK_S = 0.01
RATE_WEIGHT = 0.3  # each tick spent behind moves the measured intake rate this much


class _Waiting:
    """A request waiting for its token."""

    __slots__ = ("granted", "woken")

    def __init__(self) -> None:
        self.woken = Event()
        self.granted = False


class Intake:
    """A token bucket of ``per_tick`` tokens, refilled every ``tick_s`` while any were taken (no timer runs
    while the process is idle). For greenlets of one gevent hub.

    The requests waiting for a token are served by caller in turn (round robin), each caller's in the order they
    arrived: a tenant's call does not wait behind another tenant's line. Beside a flood's line at intake, a
    steady tenant's call used to wait out the whole line (up to a second, measured) in the moment the flood
    began, before the door counted it as light. One line per caller with requests waiting: the table is no
    larger than the requests waiting, and the door bounds those (it refuses a request whose wait here would pass
    ``LLMB_DOOR_MAX_DELAY_MS``)."""

    def __init__(self, per_tick: int = PER_TICK, tick_s: float = TICK_S) -> None:
        self.per_tick = per_tick
        self.tick_s = tick_s
        self._tokens = per_tick  # free
        self._granted = 0  # handed to requests waiting that have not run yet (taken once they run)
        self._lines: OrderedDict[str, deque[_Waiting]] = OrderedDict()  # callers with requests waiting, in turn
        self._since: OrderedDict[_Waiting, float] = OrderedDict()  # every request waiting, oldest first
        self._refilling = False
        self.rate = per_tick / tick_s  # requests a second taken in while behind (measured; at first the bound)
        self._refilled_at = 0.0

    def take(self, caller: Callable[[], str] = lambda: "") -> float | None:
        """Wait for a token (at once unless ``per_tick`` requests started in this tick already, or others wait);
        how long it waited in line, None when it did not. ``caller``: who sends the request (asked only when it
        must wait)."""
        waited = None
        if self._since or self._tokens <= 0:  # behind others: in its caller's line
            began = time.monotonic()
            waiting = _Waiting()
            self._lines.setdefault(caller(), deque()).append(waiting)
            self._since[waiting] = began
            self._hand_out()  # tokens left (the ones granted have not run yet): in turn, at once
            try:
                waiting.woken.wait()
            except BaseException:  # killed while waiting: out of line, its token (if it had one) to the next
                self._leave(waiting)
                raise
            del self._since[waiting]  # counted as waiting until it runs: the door's view of the backlog
            self._granted -= 1
            waited = time.monotonic() - began
        else:
            self._tokens -= 1
        if not self._refilling:
            self._refilling, self._refilled_at = True, time.monotonic()
            gevent.spawn_later(self.tick_s, self._refill)
        return waited

    def give_back(self) -> None:
        """Return the token of a request refused at its turn (a few header lookups and one write): the next in
        line need not wait a tick for it."""
        if self._tokens + self._granted < self.per_tick:
            self._tokens += 1
            self._hand_out()

    @property
    def waiting(self) -> int:
        """Requests waiting for a token now."""
        return len(self._since)

    def expected_wait_s(self) -> float:
        """How long a request arriving now would wait for its turn: those in line at the measured rate, or the
        time the first in line has waited so far, whichever is longer (0 when none waits). (A caller with no
        line of its own is served sooner: this is the door's bound for a heavy one.)"""
        oldest = next(iter(self._since.values()), None)
        if oldest is None:
            return 0.0
        return max(len(self._since) / self.rate, time.monotonic() - oldest)

    def _hand_out(self) -> None:
        """Tokens to the callers waiting, one each in turn, while any are left."""
        while self._tokens > 0 and self._lines:
            caller, line = next(iter(self._lines.items()))
            waiting = line.popleft()
            if line:
                self._lines.move_to_end(caller)
            else:
                del self._lines[caller]
            self._tokens -= 1
            self._granted += 1
            waiting.granted = True
            waiting.woken.set()

    def _leave(self, waiting: _Waiting) -> None:
        self._since.pop(waiting, None)
        if waiting.granted:  # its token unused: free again
            self._granted -= 1
            self._tokens += 1
            self._hand_out()
            return
        for caller, line in self._lines.items():
            if waiting in line:
                line.remove(waiting)
                if not line:
                    del self._lines[caller]
                return

    def _refill(self) -> None:
        now = time.monotonic()
        taken = self.per_tick - self._tokens - self._granted  # by requests that ran this tick
        if self._since and taken == self.per_tick and now > self._refilled_at:  # a tick spent behind
            sample = taken / (now - self._refilled_at)
            self.rate += RATE_WEIGHT * (sample - self.rate)
        self._refilled_at = now
        self._tokens = self.per_tick - self._granted
        self._hand_out()
        if taken:
            gevent.spawn_later(self.tick_s, self._refill)
        else:
            self._refilling = False
