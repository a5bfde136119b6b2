"""The live fleet view: GPU workers' heartbeats in Redis.

Each worker overwrites one field of a single Redis hash at a fixed interval, so reading the whole fleet is
one HGETALL. A worker whose last heartbeat is older than ``heartbeat_stale_factor`` intervals is stale: it
is left out of :meth:`Fleet.live`, and the batcher that finds it lost removes it from the hash.
Timestamps are epoch seconds (they cross hosts).
"""
from __future__ import annotations

import redis

from tasks.schema import DRAINING, WorkerInfo


class Fleet:
    """Reads and writes heartbeats. Thin: the routing decision lives in :mod:`tasks.policy.scheduler`."""

    def __init__(self, client: redis.Redis, key: str, stale_after_s: float) -> None:
        self.client = client
        self.key = key
        self.stale_after_s = stale_after_s

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
