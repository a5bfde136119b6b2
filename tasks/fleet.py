"""The live fleet view: GPU workers' heartbeats in Redis.

Each worker overwrites one field of a single Redis hash at a fixed interval, so reading the whole fleet is
one HGETALL. A worker whose last heartbeat is older than ``heartbeat_stale_factor`` intervals is stale: it
is left out of :meth:`Fleet.live`, and the batcher that finds it lost removes it from the hash.
Timestamps are epoch seconds (they cross hosts).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis
from kombu import Exchange

DRAINING = "draining"


@dataclass(frozen=True)
class WorkerInfo:
    id: str  # Celery hostname, e.g. gpu0@host
    queue: str  # the worker's own batch queue
    model: str
    max_batch: int
    state: str  # "idle", "busy" or DRAINING (stopping: finishing its batch, taking no more)
    outstanding: int  # batches received and not finished, the running one included
    completed: int  # batches finished since the worker started
    batch_started_at: float | None  # when the running batch started, if busy
    batch_ms_estimate: float  # moving average of batch run time
    heartbeat_at: float
    free_in_ms: float = 0.0  # estimated time until the running batch ends
    kind: str = "sim"  # "sim", "causal" or "embed"
    slots: int = 1  # batches it runs at once (continuous batching: several share the decode batch)
    kv_tokens: int = 0  # continuous batching: tokens its KV cache holds, the real limit on concurrency
    tokens_per_s: float = 0.0  # over the last minute
    utilisation: float = 0.0  # fraction of the last minute spent running batches
    max_context: int = 0  # tokens per item (prompt + output), 0 when it does not apply

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "WorkerInfo":
        return cls(**json.loads(raw))


class Fleet:
    """Reads and writes heartbeats. Thin: the routing decision lives in :mod:`tasks.scheduler`."""

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


def fleet_exchange(namespace: str) -> Exchange:
    """Fanout on which workers announce each batch they start and finish; every batcher binds its own queue.

    Announcements are transient: one lost only delays the scheduler (see Scheduler.forget_after_s).
    """
    return Exchange(f"{namespace}.fleet", type="fanout", durable=False, delivery_mode=1)


@dataclass(frozen=True)
class BatchEvent:
    """A worker started or finished a batch: the scheduler's view of each device, as it happens."""

    worker: str
    batch_id: str
    event: str  # "started" or "finished"
    run_ms: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> "BatchEvent":
        event = str(d["event"])
        if event not in ("started", "finished"):
            raise ValueError(f"unknown batch event {event!r}")
        run_ms = d.get("run_ms")
        return cls(worker=str(d["worker"]), batch_id=str(d["batch_id"]), event=event,
                   run_ms=None if run_ms is None else float(run_ms))  # type: ignore[arg-type]
