"""The live fleet view: GPU workers' heartbeats in Redis.

Each worker overwrites one field of a single Redis hash at a fixed interval, so reading the whole fleet is
one HGETALL. A worker whose last heartbeat is older than ``heartbeat_stale_factor`` intervals is stale: it
is left out of :meth:`Fleet.live`, and the batcher that finds it lost removes it from the hash.
Timestamps are epoch seconds (they cross hosts).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import redis

from tasks.config import Settings
from tasks.schema import DRAINING, WorkerInfo
from tasks.state.keys import Keys


class Fleet:
    """Reads and writes heartbeats. Thin: the routing decision lives in :mod:`tasks.policy.scheduler`."""

    def __init__(self, client: redis.Redis, key: str, stale_after_s: float) -> None:
        self.client = client
        self.key = key
        self.stale_after_s = stale_after_s

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> Fleet:
        return cls(client, Keys.from_settings(settings).fleet, settings.worker.heartbeat_stale_s)

    def beat(self, info: WorkerInfo) -> None:
        self.client.hset(self.key, info.id, info.to_json())

    def leave(self, worker_id: str) -> None:
        self.client.hdel(self.key, worker_id)

    def all(self) -> list[WorkerInfo]:
        workers = []
        for raw in self.client.hgetall(self.key).values():
            try:
                workers.append(WorkerInfo.from_json(raw))
            except (ValueError, TypeError):
                continue  # a heartbeat from an incompatible version: ignore rather than crash the reader
        return workers

    def live(self, now: float, *, draining: bool = False) -> list[WorkerInfo]:
        """Workers that may be given work: heartbeat fresh and (unless ``draining``) not stopping. The API
        counts stopping workers as serving their model: a restart must not flap it to 503."""
        return [w for w in self.all()
                if now - w.heartbeat_at <= self.stale_after_s and (draining or w.state != DRAINING)]


class FleetCache:
    """The live fleet as a process sees it: read from Redis at most once per ``max_age_s`` (half a heartbeat
    interval: heartbeats change no faster), so routing and admission cost no Redis round trip per request."""

    def __init__(self, fleet: Fleet, max_age_s: float, *, draining: bool = False,
                 clock: Callable[[], float] = time.monotonic, wallclock: Callable[[], float] = time.time) -> None:
        self.fleet = fleet
        self.wallclock = wallclock  # the shared clock heartbeats are written on (tasks.state.clock)
        self.max_age_s = max_age_s
        self.draining = draining
        self.clock = clock
        self.last: list[WorkerInfo] = []
        self._read_at: float | None = None

    def get(self, fresh: bool = False) -> list[WorkerInfo]:
        """The live workers; read now if ``fresh`` or the last read is too old. Redis errors propagate, and the
        next call tries again (or :meth:`keep` the last view)."""
        now = self.clock()
        if fresh or self._read_at is None or now - self._read_at > self.max_age_s:
            self.last = self.fleet.live(self.wallclock(), draining=self.draining)
            self._read_at = now
        return self.last

    def keep(self) -> list[WorkerInfo]:
        """Go on with the last view for another ``max_age_s`` (Redis is away: do not ask it at every call)."""
        self._read_at = self.clock()
        return self.last

    def invalidate(self) -> None:
        self._read_at = None
