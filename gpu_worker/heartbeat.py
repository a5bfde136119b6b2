"""Heartbeat: a worker bootstep whose thread reports this worker to the fleet view at a fixed interval.

A thread of its own, so that a heartbeat never waits behind the model or the event loop: a busy worker is
exactly the one whose state the scheduler needs.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from celery import Celery, bootsteps
from celery.worker import state as celery_state
from kombu import Connection, Queue

from gpu_worker.backends.interface import NO_ADAPTERS, NO_PREFIX_CACHE, AdapterState, PrefixCache
from gpu_worker.worker_state import WorkerState
from tasks.broker.queues import RETRY_POLICY, fleet_exchange
from tasks.config import Settings
from tasks.schema import DRAINING, STARTING, Batch, BatchEvent, Failure, WorkerInfo
from tasks.state.fleet import Fleet

log = logging.getLogger("llmb.worker")


class HeartbeatStep(bootsteps.StartStopStep):
    """Starts the heartbeat with the pool, as "starting" until the consumer consumes (:meth:`WorkerRuntime.ready`).
    It keeps beating through a graceful stop (as "draining") until :meth:`WorkerRuntime.leave`, which runs once
    everything the worker held was handed back."""

    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.runtime: WorkerRuntime = w.app.conf["llmb_worker"]

    def start(self, w: Any) -> None:
        self.runtime.start_heartbeat()


class WorkerRuntime:
    """What one worker process is: its id, queue, backend and live state."""

    def __init__(self, worker_id: str, queue: str, model: str, max_batch: int, fleet: Fleet,
                 state: WorkerState, settings: Settings, kind: str = "sim", max_context: int = 0,
                 slots: int = 1, kv_tokens: int = 0, kv_used: Callable[[], int] = lambda: 0,
                 prefix_cache: Callable[[], PrefixCache] = lambda: NO_PREFIX_CACHE,
                 adapters: Callable[[], AdapterState] = lambda: NO_ADAPTERS) -> None:
        self.kind = kind
        self.adapters = adapters  # the backend's LoRA adapters (none where it serves none)
        self.prefix_cache = prefix_cache  # the backend's prefix-cache figures (none where it keeps no cache)
        self.slots = slots
        self.kv_tokens = kv_tokens
        self.kv_used = kv_used  # the backend's KV tokens in use now (0 where it keeps no such count)
        self.max_context = max_context
        self.worker_id = worker_id
        self.queue = queue
        self.model = model
        self.max_batch = max_batch
        self.fleet = fleet
        self.state = state
        self.settings = settings
        self.draining = False
        self.starting = True  # until the consumer consumes: a batch sent before would wait, and look lost
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._beating = threading.Lock()  # a beat in progress never lands after leave()

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

    def ready(self) -> None:
        """The consumer consumes this worker's queue: batches may be sent to it (beat so at once). Its first
        beats, as "starting", already ended a restart's hold: the API counts a starting worker as serving."""
        self.starting = False
        self._wake.set()

    def begin_drain(self) -> None:
        """Tell the batchers at once that this worker takes no more batches."""
        self.draining = True
        self._wake.set()

    def leave(self) -> None:
        """Stop beating and leave the fleet view (everything this worker held has been handed back). A graceful
        stop is most often a restart (a rollout): the worker is awaited back for ``LLMB_RESTART_HOLD_S``, during
        which API processes keep admitting its model's calls if it was the model's only worker
        (:meth:`tasks.state.fleet.Fleet.depart`)."""
        with self._beating:
            self._stop.set()
        self._wake.set()
        try:
            self.fleet.depart(self.info(), self.settings.worker.restart_hold_s)
        except Exception as exc:  # Redis may be gone; the entry goes stale on its own
            log.warning("could not remove heartbeat: %s", exc)

    def _loop(self) -> None:
        interval = self.settings.worker.heartbeat_interval_s
        awaited = True  # a replacement is awaited until its first beat is in (then the hold is cleared)
        while True:
            try:
                with self._beating:
                    if self._stop.is_set():
                        return
                    self.fleet.beat(self.info())
                if awaited:
                    self.fleet.back(self.worker_id)
                    awaited = False
            except Exception as exc:  # keep beating: Redis may come back (the hold lapses on its own)
                log.warning("heartbeat failed: %s", exc)
            self._wake.wait(interval)
            self._wake.clear()

    def info(self) -> WorkerInfo:
        now = self.state.clock()
        tokens_per_s, utilisation = self.state.rates(now)
        started = self.state.batch_started_at
        cache = self.prefix_cache()
        adapters = self.adapters()
        return WorkerInfo(
            id=self.worker_id, queue=self.queue, model=self.model, max_batch=self.max_batch,
            state=(DRAINING if self.draining else STARTING if self.starting
                   else "busy" if started is not None else "idle"),
            outstanding=len(celery_state.reserved_requests),
            completed=self.state.completed, batch_started_at=started,
            batch_ms_estimate=round(self.state.batch_ms_estimate, 3), heartbeat_at=now,
            free_in_ms=round(self.state.free_in_ms(now), 1), kind=self.kind, max_context=self.max_context,
            tokens_per_s=round(tokens_per_s, 1), utilisation=round(utilisation, 3), slots=self.slots,
            kv_tokens=self.kv_tokens, kv_used=self.kv_used(), prefix_caching=cache.caching,
            prefix_queries=cache.queries, prefix_hits=cache.hits, cached_blocks=cache.blocks, prefixes=cache.keys,
            max_adapters=adapters.max_adapters, adapters=adapters.resident, adapters_loading=adapters.loading,
            adapter_loads=adapters.loads, adapter_evictions=adapters.evictions,
        )


class Announcer:
    """Publishes this worker's batch events to every batcher (the scheduler's start/finish signal).

    Never raises: a lost announcement only delays the scheduler, which forgets unheard batches in time. So
    announcements go on a connection of their own *without* publisher confirms, and from a thread of their own,
    in the order they were made: the "started" one is made between the device's claim and its run, where
    publishing it took 0.4 ms (p50) to 3 ms (p90) of every batch's device time (measured at 150% load on a
    saturated host). Its timing does not suffer: the event carries the shared-clock time of the start.
    """

    def __init__(self, broker_url: str, namespace: str) -> None:
        self.connection = Connection(broker_url, connect_timeout=2)
        self.exchange = fleet_exchange(namespace)
        self._events: queue.SimpleQueue[BatchEvent] = queue.SimpleQueue()
        threading.Thread(target=self._publish_all, name="announcer", daemon=True).start()

    def __call__(self, event: BatchEvent) -> None:
        self._events.put(event)

    def _publish_all(self) -> None:
        while True:
            self._publish(self._events.get())

    def _publish(self, event: BatchEvent) -> None:
        try:
            producer = self.connection.Producer()
            self.connection.ensure(producer, producer.publish, **RETRY_POLICY)(
                event.to_dict(), exchange=self.exchange, routing_key="", declare=[self.exchange],
                serializer="json")
        except Exception as exc:
            log.warning("could not announce %s of batch %s: %s", event.event, event.batch_id, exc)


class GiveBack:
    """Hands a batch this worker cannot finish back to the batchers, durably (before its task is acked)."""

    def __init__(self, app: Celery, queue: Queue, worker_id: str) -> None:
        self.app = app
        self.queue = queue  # the recovery queue (tasks.broker.queues.recovery_queue)
        self.worker_id = worker_id

    def __call__(self, batch: Batch, failure: Failure, error: str, blame: str) -> None:
        with self.app.producer_or_acquire() as producer:
            producer.publish({"batch": batch.to_dict(), "failure": str(failure), "error": error,
                              "worker": self.worker_id, "blame": blame},
                             exchange="", routing_key=self.queue.name, declare=[self.queue], serializer="json",
                             delivery_mode=2, retry=True, retry_policy=RETRY_POLICY)
