"""The front door's own limit: inference requests one API process holds at once, counted in memory.

The admission caps (``LLMB_ADMISSION_CAP`` + ``LLMB_OFFLINE_ADMISSION_CAP``) are kept in Redis across every API
process; each process of a host serves its share of them (gunicorn_conf sizes its connections for that share
plus a margin). A process already holding its share of requests cannot admit more anyway, so it refuses the
next at once (429 queue_full with Retry-After) from this counter: before the body is read, before Redis or the
database is asked, so that a refusal costs far less than an admission and a flood cannot crowd out the
callers already admitted.
"""
from __future__ import annotations

import math
import threading

from tasks.config import Settings
from tasks.errors import QueueFull


def process_share(settings: Settings) -> int:
    """Requests one API process may hold: its even share of both admission caps (gunicorn_conf adds a margin)."""
    return math.ceil((settings.admission_cap + settings.offline_admission_cap) / max(1, settings.web_workers))


class Door:
    """Counts the requests this process holds; :meth:`enter` refuses beyond ``limit``."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.held = 0
        self._lock = threading.Lock()  # gevent's own lock once gunicorn's worker has monkey-patched threading

    @classmethod
    def from_settings(cls, settings: Settings) -> Door:
        return cls(process_share(settings), settings.retry_after_s)

    def enter(self) -> None:
        """Count one more request held, or raise QueueFull (nothing counted) when the process holds its share."""
        with self._lock:
            if self.held >= self.limit:
                raise QueueFull(f"this API process holds {self.held} requests, its share of the admission caps; "
                                f"retry in {self.retry_after_s} s", retry_after_s=self.retry_after_s)
            self.held += 1

    def leave(self) -> None:
        with self._lock:
            self.held -= 1
