"""How many batches each worker of a multi-host harness has outstanding, sampled from its client host under load:
what the batchers' pool and prefetch promise (LLMB_MAX_OUTSTANDING_BATCHES), checked as RabbitMQ and the
heartbeats show it."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import TYPE_CHECKING

import redis
from kombu import Connection

from harness.helpers import decoded
from harness.netns.topology import enter_netns

if TYPE_CHECKING:
    from harness.netns.hosts import Hosts


class OutstandingSampler:
    """Samples, from the client host, the batches outstanding on each worker: ready in its queue plus those it
    holds (unacknowledged). RabbitMQ leaves a message ready only while its consumer's prefetch (``prefetch``,
    LLMB_MAX_OUTSTANDING_BATCHES) is full, so outstanding = ready + prefetch when ready > 0 (in two samples
    running, so that a message caught on its way to a consumer with room does not count), else what the
    worker's last heartbeat reports holding; with no consumer (its connection closed) it is what is ready.
    Only workers in the pool count (a fresh heartbeat): a cut-off worker's queue is the batchers' to take back.
    Passive declares every ``interval_s`` (cheap), heartbeats every fourth sample."""

    def __init__(self, hosts: Hosts, interval_s: float = 0.05, prefetch: int = 2) -> None:
        self.h = hosts
        self.interval_s = interval_s
        self.prefetch = prefetch
        self.max_outstanding: dict[str, int] = {}
        self.max_ready: dict[str, int] = {}
        self.max_at: dict[str, float] = {}  # seconds after the start when each maximum was first seen
        self.started_at = time.monotonic()
        self.samples = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outstanding-sampler", daemon=True)

    def __enter__(self) -> OutstandingSampler:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _read_fleet(self, client: redis.Redis, held: dict[str, int], fresh: dict[str, bool]) -> None:
        """What each worker's heartbeat says it holds, and whether that heartbeat is fresh (the worker in the pool)."""
        now = time.time()
        for wid, raw in client.hgetall(f"{self.h.namespace}:fleet").items():
            beat, host = json.loads(raw), decoded(wid).split("@", 1)[1]
            held[host] = int(beat.get("outstanding") or 0)
            fresh[host] = now - float(beat.get("heartbeat_at") or 0) < self.h.heartbeat_stale_s

    def _run(self) -> None:
        enter_netns(self.h.hosts["client"].ns)
        client = redis.Redis.from_url(self.h.redis_url, socket_timeout=1, socket_connect_timeout=1)
        held: dict[str, int] = {}
        fresh: dict[str, bool] = {}
        last_ready: dict[str, int] = {}
        conn: Connection | None = None
        n = 0
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = Connection(self.h.broker_url, connect_timeout=1)
                    conn.connect()
                channel = conn.default_channel
                if n % 4 == 0:
                    self._read_fleet(client, held, fresh)
                for host in self.h.gpu_hosts:
                    _, ready, consumers = channel.queue_declare(self.h.gpu_queue(host), passive=True)
                    if not fresh.get(host):  # out of the pool (cut off, say): nobody sends it anything
                        continue
                    # ready in two samples running: a message caught between its enqueue and its delivery to a
                    # consumer with room is not waiting (a batch beyond the prefetch waits a whole batch time)
                    waiting, last_ready[host] = min(int(ready), last_ready.get(host, 0)), int(ready)
                    if not consumers:  # its connection is gone: what it held is back in the queue, ready
                        out = waiting
                    elif waiting:  # a full prefetch held besides what waits
                        out = waiting + self.prefetch
                    else:  # what the worker says it holds
                        out = held.get(host, 0)
                    if out > self.max_outstanding.get(host, -1):
                        self.max_outstanding[host] = out
                        self.max_at[host] = round(time.monotonic() - self.started_at, 2)
                    self.max_ready[host] = max(self.max_ready.get(host, 0), waiting)
                self.samples += 1
            except Exception:
                self.errors += 1
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.release()
                conn = None
            n += 1
            self._stop.wait(self.interval_s)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.release()
