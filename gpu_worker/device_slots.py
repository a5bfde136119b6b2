"""The device's slots as the batch runner takes them: a semaphore that also knows how long the device sat free."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

HOST_THREADS = 1  # batch threads beyond the device's slots: they write results while the device runs the next batch


class Device:
    """The device's slots, and since when it has sat free: a batch that finds it free came late, and says by how
    much (``idle_ms`` of its "started" announcement), so that the batchers learn to hand the next one over sooner.
    """

    def __init__(self, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.clock = clock
        self._free = threading.Semaphore(slots)
        self._lock = threading.Lock()
        self._held = 0
        self._free_since: float | None = clock()  # None while every slot is taken

    def acquire(self) -> None:
        self._free.acquire()
        with self._lock:
            self._held += 1
            if self._held >= self.slots:
                self._free_since = None

    def release(self) -> None:
        with self._lock:
            self._held -= 1
            if self._free_since is None:
                self._free_since = self.clock()
        self._free.release()

    def idle_s(self) -> float | None:
        """How long a slot has been free (0: all are taken; None with several slots: a slot free is no news)."""
        if self.slots != 1:
            return None
        with self._lock:
            since = self._free_since
        return 0.0 if since is None else self.clock() - since


class Held:
    """A slot of the device, taken when made; released at the first :meth:`release` (or the end of a ``with``)."""

    def __init__(self, slots: Device) -> None:
        slots.acquire()
        self._slots: Device | None = slots

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
