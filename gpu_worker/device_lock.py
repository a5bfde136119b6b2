"""One worker per device: an exclusive RabbitMQ queue held for the worker's life, taken before the model loads.

Two ``gpu-worker --gpu 0`` on one host share everything that names a worker (``gpu0@<host>``): its batch queue,
its heartbeat in the fleet view and Celery's remote-control queue. Without this lock the second one loaded its
model, beat into the first one's heartbeat, then died on Celery's exclusive remote-control queue
(RESOURCE_LOCKED) and, leaving, emptied the first one's batch queue and removed its heartbeat; its supervisor
started it again every few seconds, for ever.

The lock is a queue declared *exclusive* (``<namespace>.device.<worker id>``): RabbitMQ lets one connection hold
it and deletes it the moment that connection closes, so the lock lives exactly as long as the holder's broker
connection. A process that dies, SIGKILL included, releases it at once (its kernel closes the socket); a host
that vanishes releases it when RabbitMQ misses its AMQP heartbeats (``LLMB_BROKER_HEARTBEAT_S``). The holder
writes who it is (host, pid) to Redis, ``<namespace>:device:<worker id>``, so a refused worker can say who holds
its device; the queue, not that record, is the lock.

A second worker finding the lock held refuses to start (:class:`DeviceTaken`, and exit code ``DEVICE_TAKEN``,
which its supervisor does not restart), unless the holder looks dead (:func:`holder_looks_alive`): a pid on this
host that no longer runs, or a heartbeat gone stale. Then it waits, up to :func:`release_grace_s`, for RabbitMQ
to notice, so a worker restarted right after its predecessor crashed takes its device back instead of being
refused.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
from amqp.exceptions import ResourceLocked
from kombu import Connection

from tasks.config import Settings
from tasks.schema import WorkerInfo
from tasks.state.clock import SharedClock
from tasks.state.fleet import Fleet

log = logging.getLogger("llmb.worker")

RETRY_INTERVAL_S = 0.2  # while waiting for a dead holder's lock to be released, and between reconnects
RECONNECT_MAX_S = 5.0


class DeviceTaken(Exception):
    """Raised when another live worker holds this worker's device (its lock queue is held on another connection)."""

    def __init__(self, worker_id: str, holder: Holder | None, heartbeat: WorkerInfo | None,
                 heartbeat_age_s: float | None, *, alive: bool) -> None:
        self.worker_id = worker_id
        self.holder = holder
        self.alive = alive  # False: it looks dead, yet the broker kept its lock through the grace period
        super().__init__(describe_refusal(worker_id, holder, heartbeat, heartbeat_age_s, alive=alive))


@dataclass(frozen=True)
class Holder:
    """Who holds a device, as its holder recorded it."""

    host: str  # the machine's own name (socket.gethostname()), not --host
    pid: int
    worker: str
    queue: str
    since: float  # epoch seconds
    process_start: int | None = None  # /proc/<pid>/stat start time (ticks since boot): a reused pid is not it

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Holder:
        return cls(**json.loads(raw))

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host} (holding it since {started}, queue {self.queue})"


def holder_looks_alive(holder: Holder | None, heartbeat_age_s: float | None, *, here: str, stale_after_s: float,
                       running: Callable[[int, int | None], bool]) -> bool:
    """Whether the process holding a lock is to be believed alive (the broker says its connection is).

    A holder on this host is alive exactly when its process runs. Elsewhere, a fresh heartbeat says so; a stale
    or missing one says it may be gone (a host that vanished, whose connection the broker has yet to drop). A
    holder without a record and without a heartbeat is believed: something holds the lock, and the broker's
    own heartbeats say its connection is live."""
    if holder is not None and holder.host == here:
        return running(holder.pid, holder.process_start)
    if heartbeat_age_s is not None:
        return heartbeat_age_s <= stale_after_s
    return holder is None


def release_grace_s(settings: Settings) -> float:
    """How long to wait for the broker to drop a dead holder's lock: its AMQP heartbeat timeout (RabbitMQ closes
    a connection after two missed heartbeats) plus the fleet's staleness, with a margin."""
    return 3 * settings.broker.heartbeat_s + settings.worker.heartbeat_stale_s + 2.0


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None if it does not run or is not
    known here."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def process_running(pid: int, started: int | None) -> bool:
    """Whether ``pid`` runs and, where its start time was recorded, is still the same process."""
    if os.path.isdir("/proc/self"):
        now = process_start(pid)
        return now is not None and (started is None or now == started)
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_refusal(worker_id: str, holder: Holder | None, heartbeat: WorkerInfo | None,
                     heartbeat_age_s: float | None, *, alive: bool) -> str:
    who = holder.describe() if holder is not None else "a process that left no record in Redis"
    beat = (f"; its heartbeat: {heartbeat.state}, {heartbeat_age_s:.1f} s ago" if heartbeat is not None
            and heartbeat_age_s is not None else "; no heartbeat from it")
    if alive:
        return (f"device {worker_id} is already held by {who}{beat}. Not starting a second worker for it: stop "
                f"that one first, or start this one with another --gpu or --host.")
    return (f"device {worker_id} is still held by {who}{beat}, which looks dead, but the broker has not released "
            f"its lock; it does once it misses that connection's heartbeats (or close it: rabbitmqctl "
            f"close_connection). Try again shortly.")


class DeviceLock:
    """Holds ``<namespace>.device.<worker id>`` on a broker connection of its own for the worker's life.

    A thread keeps the connection's AMQP heartbeats going, and takes the lock again after a lost connection (a
    broker restart, ``rabbitmqctl close_all_connections``)."""

    def __init__(self, broker_url: str, namespace: str, worker_id: str, queue: str, client: redis.Redis,
                 fleet: Fleet, clock: Callable[[], float], *, heartbeat_s: float, stale_after_s: float,
                 grace_s: float) -> None:
        self.broker_url = broker_url
        self.name = f"{namespace}.device.{worker_id}"
        self.record_key = f"{namespace}:device:{worker_id}"
        self.worker_id = worker_id
        self.client = client
        self.fleet = fleet
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.grace_s = grace_s
        self.here = socket.gethostname()
        self.me = Holder(host=self.here, pid=os.getpid(), worker=worker_id, queue=queue, since=time.time(),
                         process_start=process_start(os.getpid()))
        self._connection: Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_settings(cls, settings: Settings, worker_id: str, queue: str, client: redis.Redis) -> DeviceLock:
        return cls(settings.broker.url, settings.broker.namespace, worker_id, queue, client,
                   Fleet.from_settings(settings, client), SharedClock.from_settings(settings, client),
                   heartbeat_s=settings.broker.heartbeat_s, stale_after_s=settings.worker.heartbeat_stale_s,
                   grace_s=release_grace_s(settings))

    # -- taking it ---------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lock, waiting for the broker as long as it is unreachable (as Celery does at start). Raises
        :class:`DeviceTaken` when a live worker holds it, or a dead-looking one still does after ``grace_s``."""
        give_up: float | None = None
        while True:
            connection = self._connect()
            try:
                self._declare(connection)
            except ResourceLocked:
                _quietly(connection.release)
                holder, heartbeat, age = self._holder()
                alive = holder_looks_alive(holder, age, here=self.here, stale_after_s=self.stale_after_s,
                                           running=process_running)
                give_up = give_up if give_up is not None else time.monotonic() + self.grace_s
                if alive or time.monotonic() >= give_up:
                    raise DeviceTaken(self.worker_id, holder, heartbeat, age, alive=alive) from None
                log.warning("device %s is held by %s, which looks dead; waiting for the broker to release it",
                            self.worker_id, holder.describe() if holder else "an unknown process")
                time.sleep(RETRY_INTERVAL_S)
                continue
            except connection.connection_errors as exc:
                _quietly(connection.release)
                log.warning("could not take the lock of device %s (%s); trying again", self.worker_id, exc)
                time.sleep(RETRY_INTERVAL_S)
                continue
            self._connection = connection
            self._record()
            self._thread = threading.Thread(target=self._keep, name="device-lock", daemon=True)
            self._thread.start()
            return

    def _connect(self) -> Connection:
        connection = Connection(self.broker_url, connect_timeout=5, heartbeat=self.heartbeat_s)
        connection.ensure_connection(
            max_retries=None, interval_start=RETRY_INTERVAL_S, interval_step=1.0, interval_max=RECONNECT_MAX_S,
            errback=lambda exc, interval: log.warning("broker unreachable (%s); device lock: again in %.1f s",
                                                      exc, interval))
        return connection

    def _declare(self, connection: Connection) -> None:
        channel = connection.channel()
        channel.queue_declare(queue=self.name, durable=False, exclusive=True, auto_delete=True)

    def _record(self) -> None:
        try:
            self.client.set(self.record_key, self.me.to_json())
        except redis.RedisError as exc:  # the lock holds without it; a refused worker then cannot name us
            log.warning("could not record this worker as the holder of device %s: %s", self.worker_id, exc)

    def _holder(self) -> tuple[Holder | None, WorkerInfo | None, float | None]:
        """The holder's record and heartbeat (with its age on the shared clock), each None if unknown."""
        holder = heartbeat = age = None
        try:
            raw = self.client.get(self.record_key)
            if raw is not None:
                holder = Holder.from_json(raw)
            heartbeat = next((w for w in self.fleet.all() if w.id == self.worker_id), None)
            if heartbeat is not None:
                age = max(0.0, self.clock() - heartbeat.heartbeat_at)
        except (redis.RedisError, ValueError, TypeError) as exc:
            log.warning("could not read who holds device %s: %s", self.worker_id, exc)
        return holder, heartbeat, age

    # -- keeping it --------------------------------------------------------------------------------------
    def _keep(self) -> None:
        tick = min(1.0, self.heartbeat_s / 2) if self.heartbeat_s > 0 else 1.0
        while not self._stop.is_set():
            connection = self._connection
            assert connection is not None
            try:
                with contextlib.suppress(TimeoutError):
                    connection.drain_events(timeout=tick)
                connection.heartbeat_check()
            except Exception as exc:  # the connection is gone, and the queue with it: take it again
                if self._stop.is_set():
                    return
                log.warning("device lock of %s lost with its broker connection (%s); taking it again",
                            self.worker_id, exc)
                self._retake(connection)

    def _retake(self, lost: Connection) -> None:
        _quietly(lost.release)
        while not self._stop.is_set():
            connection = self._connect()
            try:
                self._declare(connection)
            except ResourceLocked:
                _quietly(connection.release)
                holder, _, _ = self._holder()
                log.error("device %s was taken by %s while this worker's broker connection was down: two workers "
                          "now serve one device; stop one of them", self.worker_id,
                          holder.describe() if holder else "another process")
                self._stop.wait(RECONNECT_MAX_S)
                continue
            except Exception as exc:
                _quietly(connection.release)
                log.warning("could not take the lock of device %s again (%s)", self.worker_id, exc)
                self._stop.wait(RETRY_INTERVAL_S)
                continue
            self._connection = connection
            self._record()
            return

    # -- leaving -----------------------------------------------------------------------------------------
    def release(self) -> None:
        """Give the device up (the worker is leaving): forget the record, then close the lock's connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            raw = self.client.get(self.record_key)
            if raw is not None and (raw.decode() if isinstance(raw, bytes) else raw) == self.me.to_json():
                self.client.delete(self.record_key)
        except redis.RedisError:
            pass  # the next holder overwrites it
        if self._connection is not None:
            _quietly(self._connection.release)
            self._connection = None


def _quietly(close: Callable[[], object]) -> None:
    """Close something that may already be broken."""
    try:
        close()
    except Exception as exc:
        log.debug("closing the device lock's connection: %s", exc)
