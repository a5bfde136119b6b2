"""The one fake clock of the unit tests: time that moves only when a test (or a fake sleep) moves it."""
from __future__ import annotations

import threading


class FakeClock:
    """A clock to inject where the code takes ``clock: Callable[[], float]``; ``sleep`` to inject where it sleeps."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []  # every sleep asked for, in order
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time on by ``seconds``; the new time."""
        with self._lock:
            self.now += seconds
            return self.now

    def sleep(self, seconds: float) -> None:
        """A sleep that returns at once, having moved the clock on."""
        self.sleeps.append(seconds)
        self.advance(seconds)
