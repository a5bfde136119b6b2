"""Rounds at the door: the calls an API process has ready while its previous round trip is in flight go on
together, as one admission script call and one AMQP message.

Admitting a call costs an API process two round trips (the admission script, the confirmed publish), and most of
their CPU is per message, not per call. So calls that arrive while a round is in flight do not start rounds of
their own: they wait for it and go in the next one. The rate of rounds then stays about what one caller at a
time would make, and a round grows with the load instead: under a flood each message carries tens of calls.
A lone call goes at once; a round waits for nothing but the one before it.

Entries ``first`` picks (a light tenant's calls: :meth:`tasks.gateway.admission_queue.AdmissionQueue.light`) take
their seats ahead of the others waiting: beside a flood's thousands of calls, a steady tenant's call would
otherwise wait out every round of the flood's line ahead of it (0.2-0.8 s, measured), where the gate and the
batchers already serve it ahead. They are few by definition, so the others' wait barely moves.

Threads or greenlets alike (the lock and events are gevent's once gunicorn's worker has monkey-patched
threading). No thread of its own: the first caller of a round runs it, then hands the next round to the first
caller still waiting.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

ROUND_MAX_CALLS = 64  # the gateway's rounds: calls admitted in one script call and published in one message, at most

E = TypeVar("E")
R = TypeVar("R")
Run = Callable[[Sequence[E], Callable[[], None]], Sequence["R | Exception"]]


@dataclass(eq=False)
class _Seat(Generic[E, R]):
    entry: E
    woken: threading.Event = field(default_factory=threading.Event)
    leads: bool = False  # woken to run the next round, not with an outcome
    outcome: R | Exception | None = None


class Rounds(Generic[E, R]):
    """Runs ``run(entries, hand_on)`` on the entries waiting together, at most ``max_size`` at a time, one round
    at a time. ``run`` returns one outcome per entry, in order: a value for :meth:`join` to return or an exception
    for it to raise. It may call ``hand_on()`` to let the next round start before it returns (once only waiting is
    left, say for a broker's confirm, which must not hold up the next round's admission). If ``run`` itself
    raises, every caller of the round gets that error; if it is interrupted (a BaseException such as a killed
    greenlet), the others of the round get ``abandoned()``. ``first``: whether an entry goes ahead of the others
    waiting (after those it picked before it)."""

    def __init__(self, run: Run[E, R], max_size: int, abandoned: Callable[[], Exception],
                 first: Callable[[E], bool] | None = None) -> None:
        self.run = run
        self.max_size = max_size
        self.abandoned = abandoned
        self.first = first
        self._lock = threading.Lock()
        self._ahead: list[_Seat[E, R]] = []  # the entries ``first`` picked, in arrival order
        self._waiting: list[_Seat[E, R]] = []  # the others
        self._busy = False  # a round is in flight (or about to start): new entries wait for the next one

    def join(self, entry: E) -> R:
        """Go in the next round with whatever else is waiting; the entry's outcome."""
        seat: _Seat[E, R] = _Seat(entry)
        ahead = self.first is not None and self.first(entry)
        with self._lock:
            (self._ahead if ahead else self._waiting).append(seat)
            leads, self._busy = not self._busy, True
        if not leads:
            seat.woken.wait()
        if leads or seat.leads:
            self._lead(seat)
        outcome = seat.outcome
        if isinstance(outcome, Exception):
            raise outcome
        return outcome  # type: ignore[return-value]

    def _lead(self, own: _Seat[E, R]) -> None:
        """Run a round of ``own`` (whose caller leads it) and the first others waiting."""
        time.sleep(0)  # let callers that are ready to join (other greenlets, parsed and checked) take their seats
        with self._lock:
            (self._ahead if own in self._ahead else self._waiting).remove(own)  # others may have gone ahead of it
            seats = [own, *self._take(self._ahead, self.max_size - 1)]
            seats += self._take(self._waiting, self.max_size - len(seats))
        finished, handed = False, threading.Event()

        def hand_on() -> None:
            if not handed.is_set():
                handed.set()
                self._hand_on()

        try:
            try:
                outcomes: Sequence[R | Exception] = self.run([s.entry for s in seats], hand_on)
                assert len(outcomes) == len(seats), "one outcome per entry"
            except Exception as exc:
                outcomes = [exc] * len(seats)
            for seat, outcome in zip(seats, outcomes):
                seat.outcome = outcome
            finished = True
        finally:
            for seat in seats:
                if not finished:
                    seat.outcome = self.abandoned()
                seat.woken.set()
            hand_on()

    @staticmethod
    def _take(seats: list[_Seat[E, R]], n: int) -> list[_Seat[E, R]]:
        """The first ``n`` of ``seats``, taken out of it."""
        taken = seats[:n]
        del seats[:n]
        return taken

    def _hand_on(self) -> None:
        """Wake the first waiting caller to run the next round, or mark the door idle."""
        with self._lock:
            line = self._ahead or self._waiting
            if not line:
                self._busy = False
                return
            nxt = line[0]
        nxt.leads = True
        nxt.woken.set()

    def __len__(self) -> int:
        """Entries waiting for a round now."""
        return len(self._ahead) + len(self._waiting)
