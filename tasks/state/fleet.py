"""The live fleet view: GPU workers' heartbeats in Redis.

Each worker overwrites one field of a single Redis hash at a fixed interval, so reading the whole fleet is
one HGETALL. A worker whose last heartbeat is older than ``heartbeat_stale_factor`` intervals is stale: it
is left out of :meth:`Fleet.live`, and the batcher that finds it lost removes it from the hash.
Timestamps are epoch seconds (they cross hosts).

The models a process knows (:meth:`FleetCache.knows`) are those of every worker in the hash, live or stale, and
those seen there in the last ``KNOWN_FOR_S``: a call naming one whose workers are all down is told to retry
(503), a call naming any other is refused as not found (404) before the process keeps anything for it.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import redis

from tasks.config import Settings
from tasks.schema import DRAINING, NOT_TAKING_WORK, WorkerInfo
from tasks.state.keys import Keys

KNOWN_FOR_S = 300.0  # a model stays known this long after its last worker left the fleet hash

# Remove a worker's heartbeat only if it is still the one judged lost: a worker that restarted under the same id
# (a process restarted in place) meanwhile has beaten afresh, and must stay in the view.
_LEAVE_IF_SEEN = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local ok, beat = pcall(cjson.decode, raw)
if ok and type(beat) == 'table' and tonumber(beat['heartbeat_at']) and
   tonumber(beat['heartbeat_at']) > tonumber(ARGV[2]) then return 0 end
return redis.call('HDEL', KEYS[1], ARGV[1])
"""


class Fleet:
    """Reads and writes heartbeats. Thin: the routing decision lives in :mod:`tasks.policy.scheduler`."""

    def __init__(self, client: redis.Redis, key: str, stale_after_s: float, returning_key: str | None = None) -> None:
        self.client = client
        self.key = key
        self.stale_after_s = stale_after_s
        self.returning_key = returning_key or f"{key}:returning"

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> Fleet:
        keys = Keys.from_settings(settings)
        return cls(client, keys.fleet, settings.worker.heartbeat_stale_s, keys.fleet_returning)

    def beat(self, info: WorkerInfo) -> None:
        self.client.hset(self.key, info.id, info.to_json())

    def leave(self, worker_id: str, seen_at: float) -> bool:
        """Remove a worker judged lost from the view, unless it has beaten since ``seen_at`` (the heartbeat time
        the judgement read): a replacement under the same id that beat meanwhile is not the lost process.
        Whether it was removed."""
        return bool(self.client.eval(_LEAVE_IF_SEEN, 1, self.key, worker_id, repr(seen_at)))

    def depart(self, info: WorkerInfo, hold_s: float) -> None:
        """A worker stopped gracefully leaves the fleet, and (``hold_s`` > 0) is awaited back for ``hold_s``: its
        last heartbeat is kept apart, so that API processes keep admitting its model's calls while no other worker
        of the model is live (:func:`returning_of`); batchers and recovery never see it."""
        expired = [worker_id for worker_id, (until, _) in self._returning().items() if until < info.heartbeat_at]
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(self.key, info.id)
        if expired:  # each stop prunes the holds that ended: pods get new names, so ids never repeat in Kubernetes
            pipe.hdel(self.returning_key, *expired)
        if hold_s > 0:
            pipe.hset(self.returning_key, info.id, json.dumps({"until": info.heartbeat_at + hold_s,
                                                               "info": json.loads(info.to_json())}))
        pipe.execute()

    def back(self, worker_id: str) -> None:
        """A worker (re)started: it is no longer awaited."""
        self.client.hdel(self.returning_key, worker_id)

    def read(self) -> tuple[list[WorkerInfo], list[tuple[float, WorkerInfo]]]:
        """Every heartbeat, and the workers stopped gracefully and awaited back (until when, their last heartbeat),
        as of one instant (one MULTI): read apart, a replacement could beat and clear its hold between the two
        reads, and the view would hold neither it nor its hold."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.key)
        pipe.hgetall(self.returning_key)
        beats, returning = pipe.execute()
        return _workers(beats), _awaited(_returning_of(returning))

    def _returning(self) -> dict[bytes | str, tuple[float, WorkerInfo | None]]:
        return _returning_of(self.client.hgetall(self.returning_key))

    def all(self) -> list[WorkerInfo]:
        return _workers(self.client.hgetall(self.key))

    def live(self, now: float, *, draining: bool = False) -> list[WorkerInfo]:
        """Workers that may be given work: heartbeat fresh and (unless ``draining``) not starting or stopping.
        The API counts those as serving their model: a restart must not flap it to 503."""
        return live_of(self.all(), now, self.stale_after_s, draining=draining)


def _workers(beats: dict[bytes | str, bytes | str]) -> list[WorkerInfo]:
    workers = []
    for raw in beats.values():
        try:
            workers.append(WorkerInfo.from_json(raw))
        except (ValueError, TypeError):
            continue  # a heartbeat from an incompatible version: ignore rather than crash the reader
    return workers


def _awaited(returning: dict[bytes | str, tuple[float, WorkerInfo | None]]) -> list[tuple[float, WorkerInfo]]:
    return [(until, info) for until, info in returning.values() if info is not None]


def _returning_of(raws: dict[bytes | str, bytes | str]) -> dict[bytes | str, tuple[float, WorkerInfo | None]]:
    """The workers awaited back by worker id (the hash's field, as read); an unreadable entry (another version's)
    as (0, None), so that it is pruned."""
    out: dict[bytes | str, tuple[float, WorkerInfo | None]] = {}
    for worker_id, raw in raws.items():
        try:
            d = json.loads(raw)
            out[worker_id] = (float(d["until"]), WorkerInfo.from_json(json.dumps(d["info"])))
        except (ValueError, TypeError, KeyError):
            out[worker_id] = (0.0, None)
    return out


def live_of(workers: list[WorkerInfo], now: float, stale_after_s: float, *, draining: bool) -> list[WorkerInfo]:
    """The ``workers`` whose heartbeat is fresh and (unless ``draining``) that take work: not starting (beating
    before their consumer consumes) nor stopping."""
    return [w for w in workers
            if now - w.heartbeat_at <= stale_after_s and (draining or w.state not in NOT_TAKING_WORK)]


def returning_of(live: list[WorkerInfo], returning: list[tuple[float, WorkerInfo]], now: float) -> list[WorkerInfo]:
    """Workers awaited back (stopped gracefully less than their hold ago) whose model no ``live`` worker serves,
    as draining ones: a planned restart of a model's only worker is not a dead model, so its calls are admitted
    and wait for the replacement within their deadlines (pure)."""
    served = {w.model for w in live}
    ids = {w.id for w in live}
    return [replace(w, state=DRAINING) for until, w in returning
            if now <= until and w.model not in served and w.id not in ids]


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
        self._known: dict[str, float] = {}  # each model in the hash at the last reads -> when last seen there
        self._checked_at = -math.inf  # when the hash was last read for a model not known
        self._checking = threading.Lock()  # that read: one at a time (gevent's lock in the API processes)
        self._reads = 0  # reads of the hash ended so far
        self._reading = False  # a read of the hash is in flight

    def knows(self, model: str, recheck_after_s: float) -> bool:
        """Whether ``model`` is served, or was lately (:data:`KNOWN_FOR_S`), by a worker in the fleet hash, live or
        not: a dictionary lookup, the hash read again only when not found and the last read is older than
        ``recheck_after_s`` (a new worker's model is known at once, a flood of unknown names reads it rarely).
        A caller that finds that read in flight waits for it and looks again, rather than read it too or answer
        from the view before it: answering then, the second of two calls for a model whose worker had just
        joined got a 404 (CI, a process that read the fleet as it started, before the worker was up). Redis
        errors propagate."""
        if model in self._known:
            return True
        reads = self._reads  # a read that ends while this caller waits is the one it looks at
        with self._checking:
            if model not in self._known and self._reads == reads \
                    and self.clock() - self._checked_at > recheck_after_s:
                self._checked_at = self.clock()
                self.get(fresh=True)
        return model in self._known

    def get(self, fresh: bool = False) -> list[WorkerInfo]:
        """The live workers; read now if ``fresh`` or the last read is too old. Redis errors propagate, and the
        next call tries again (or :meth:`keep` the last view).

        One read at a time for an old view: a caller that finds one in flight goes on with the view before it (at
        most that read's time older) rather than read too. Each read waits for a Redis connection and a turn of the
        event loop; under a burst every arrival found the view old at once and read it (hundreds of reads, traced),
        taking the API process's Redis connections from the admission rounds: the first round's script waited
        0.6-0.9 s for one while the device sat idle. ``fresh`` reads always (a model not in the view)."""
        now = self.clock()
        if fresh or self._read_at is None or now - self._read_at > self.max_age_s:
            if not fresh and self._reading and self._read_at is not None:
                return self.last
            self._reading = True
            try:
                self._read(now)
            finally:
                self._reading = False
        return self.last

    def _read(self, now: float) -> None:
        if self.draining:  # the API's view: a model whose only worker restarts stays served (and known)
            # one read of both, into locals: reading Redis lets another greenlet in, which must never see a
            # view without the workers awaited back (a 404 for a model whose only worker restarts)
            everyone, awaited = self.fleet.read()
        else:
            everyone, awaited = self.fleet.all(), []
        wallclock = self.wallclock()
        live = live_of(everyone, wallclock, self.fleet.stale_after_s, draining=self.draining)
        if self.draining:
            returning = returning_of(live, awaited, wallclock)
            live, everyone = live + returning, everyone + returning
        self.last = live
        self._read_at = now
        self._known = {m: t for m, t in self._known.items() if now - t <= KNOWN_FOR_S}
        self._known.update((w.model, now) for w in everyone)
        self._reads += 1

    def keep(self) -> list[WorkerInfo]:
        """Go on with the last view for another ``max_age_s`` (Redis is away: do not ask it at every call)."""
        self._read_at = self.clock()
        return self.last

    def invalidate(self) -> None:
        self._read_at = None
