"""Quarantined inputs: an input that failed alone is refused at the door until an operator releases it.

The ledger keeps the durable record (one ``quarantined_inputs`` row per input, marked when released); Redis
holds the enforced copy (a set of input hashes, checked inside the admission script at no extra round trip,
and a hash of details per input). Redis runs without persistence, so a restart forgets the set: a marker key
says the set was loaded from the ledger, and :class:`QuarantineSync` (on the batcher's tick) loads it again
when the marker is gone. A release therefore goes to the ledger first, then to Redis.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import redis

from tasks.config import Settings
from tasks.state.keys import Keys

log = logging.getLogger("llmb.quarantine")


class Quarantine:
    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key  # set of hashes; details live in key + ":info"

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> Quarantine:
        return cls(client, Keys.from_settings(settings).quarantine)

    @property
    def info_key(self) -> str:
        return self.key + ":info"

    @property
    def loaded_key(self) -> str:
        """Set once the set holds the ledger's entries; a Redis that restarted or was flushed has none."""
        return self.key + ":loaded"

    def add(self, digest: str, *, model: str, reason: str, batch_id: str, request_id: str) -> None:
        info = {"hash": digest, "model": model, "reason": reason, "batch_id": batch_id,
                "request_id": request_id, "since": time.time()}
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(self.key, digest)
        pipe.hset(self.info_key, digest, json.dumps(info))
        pipe.execute()

    def release(self, digest: str) -> bool:
        pipe = self.client.pipeline(transaction=True)
        pipe.srem(self.key, digest)
        pipe.hdel(self.info_key, digest)
        removed, _ = pipe.execute()
        return bool(removed)

    def list(self) -> list[dict[str, Any]]:
        entries = [json.loads(v) for v in self.client.hgetall(self.info_key).values()]
        return sorted(entries, key=lambda e: e["since"])

    def contains(self, digest: str) -> bool:
        return bool(self.client.sismember(self.key, digest))

    def count(self) -> int:
        return int(self.client.scard(self.key))

    def members(self) -> set[str]:
        return {m.decode() if isinstance(m, bytes) else str(m) for m in self.client.smembers(self.key)}

    def is_loaded(self) -> bool:
        """One EXISTS: whether the set still holds what was loaded from the ledger."""
        return bool(self.client.exists(self.loaded_key))

    def restore(self, entries: Iterable[dict[str, Any]]) -> int:
        """Add durable entries (:meth:`tasks.store.ledger.Ledger.quarantined`) to the enforced set, then set the marker,
        in one transaction; returns how many entries there were.

        Only adds: an entry quarantined since Redis came back (and perhaps not yet in the ledger, whose writer
        is asynchronous) stays, and keeps its own details.
        """
        entries = list(entries)
        pipe = self.client.pipeline(transaction=True)
        if entries:
            pipe.sadd(self.key, *(e["hash"] for e in entries))
        for e in entries:
            pipe.hsetnx(self.info_key, e["hash"], json.dumps(e))
        pipe.set(self.loaded_key, time.time())
        pipe.execute()
        return len(entries)


class QuarantineSource(Protocol):
    """Where the durable quarantine is read from: :class:`tasks.store.ledger.Ledger`."""

    def quarantined(self) -> list[dict[str, Any]]: ...


class QuarantineSync:
    """Keeps the enforced quarantine (Redis) as complete as the durable one (the ledger), across Redis restarts.

    ``tick()`` is meant for a periodic timer (the batcher's, every half heartbeat): while the marker is there
    it costs one EXISTS; when it is gone, the ledger is read and its unreleased entries are put back, on a
    thread of its own so the caller never waits for the database. A failed reload (database or Redis away)
    is tried again ``retry_s`` later. Several batchers may reload at once: restoring is idempotent.
    ``tick()`` never raises.
    """

    def __init__(self, quarantine: Quarantine, ledger: QuarantineSource, *, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quarantine = quarantine
        self.ledger = ledger
        self.retry_s = retry_s
        self.clock = clock
        self.reloads = 0  # reloads that completed (a restarted Redis each time)
        self._not_before = 0.0
        self._thread: threading.Thread | None = None

    def tick(self) -> bool:
        """Start a reload if Redis lost the quarantine; True when one was started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        if self.clock() < self._not_before:
            return False
        try:
            if self.quarantine.is_loaded():
                return False
        except redis.RedisError as exc:  # Redis is away: nothing can be refused or restored until it is back
            log.debug("cannot check the quarantine marker: %s", exc)
            return False
        self._thread = threading.Thread(target=self._reload_or_wait, name="quarantine-reload", daemon=True)
        self._thread.start()
        return True

    def reload(self) -> int:
        """Load the ledger's unreleased entries into Redis now, and set the marker; returns how many."""
        restored = self.quarantine.restore(self.ledger.quarantined())
        self.reloads += 1
        log.log(logging.WARNING if restored else logging.INFO,
                "the quarantine was not loaded in Redis (first start, or Redis restarted or was flushed): "
                "restored %d input(s) from the ledger", restored)
        return restored

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for a reload in progress (tests, shutdown); False if one is still running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def _reload_or_wait(self) -> None:
        try:
            self.reload()
        except Exception as exc:  # database or Redis away: try again later, never take the batcher down
            self._not_before = self.clock() + self.retry_s
            log.warning("could not restore the quarantine from the ledger (%s: %s); trying again in %g s",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", self.retry_s)
