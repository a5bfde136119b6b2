"""One wall clock for every host: each process's own clock, corrected to Redis's ``TIME``.

Deadlines, heartbeats and arrival times travel between hosts as epoch seconds: an API process sets a deadline
that a batcher and a worker compare with their own "now", and a batcher judges a worker alive by its heartbeat's
time. Hosts whose clocks disagree (NTP not running, a VM resumed, a container with a drifting clock) would drop
live work as expired, or route to a dead worker, or never to a live one. So every process reads time from a
:class:`SharedClock`: its local clock plus an offset measured against the Redis server (the one clock all
processes already share; the admission scripts use ``TIME`` inside Redis), re-measured every ``resync_s``.
The offset is taken from the quickest of a few round trips, so it is good to half a round trip (well under a
millisecond on a LAN), whatever the hosts' clocks say.

The monotonic clock stays local: intervals measured inside one process need no agreement with anyone.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from tasks.config import Settings

log = logging.getLogger("llmb.clock")

SAMPLES = 3  # round trips per measurement; the quickest one wins
RETRY_S = 5.0  # after a failed measurement (Redis away), try again this soon; the last offset holds meanwhile


class SharedClock:
    """``clock()``: epoch seconds on Redis's clock. Never raises: while Redis is away the last offset holds."""

    def __init__(self, client: redis.Redis, *, resync_s: float = 60.0, skew_s: float = 0.0,
                 local: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.resync_s = resync_s
        self._local = (lambda: local() + skew_s) if skew_s else local  # skew: tests of a host whose clock is off
        self._monotonic = monotonic
        self.offset = 0.0
        self.synced = False
        self._next_sync = float("-inf")

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> SharedClock:
        return cls(client, skew_s=settings.process.clock_skew_s)

    def __call__(self) -> float:
        if self._monotonic() >= self._next_sync:
            self.sync()
        return self._local() + self.offset

    def sync(self) -> bool:
        """Measure the offset to Redis's clock now; False (the last offset kept) if Redis cannot be reached."""
        best: tuple[float, float] | None = None  # (round trip, offset)
        try:
            for _ in range(SAMPLES):
                sent = self._local()
                seconds, micros = self.client.time()
                received = self._local()
                offset = seconds + micros / 1e6 - (sent + received) / 2
                if best is None or received - sent < best[0]:
                    best = (received - sent, offset)
        except redis.RedisError as exc:
            self._next_sync = self._monotonic() + RETRY_S
            if not self.synced:
                log.warning("cannot read Redis's clock yet (%s); using this host's own meanwhile", exc)
            return False
        assert best is not None
        if abs(best[1] - self.offset) > 1.0 and self.synced:
            log.warning("this host's clock moved %.3f s against Redis's", best[1] - self.offset)
        elif abs(best[1]) > 1.0 and not self.synced:
            log.warning("this host's clock is %.3f s off Redis's; correcting for it", -best[1])
        self.offset = best[1]
        self.synced = True
        self._next_sync = self._monotonic() + self.resync_s
        return True
