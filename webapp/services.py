"""What every route of one API process shares, built once by :func:`webapp.create_app` and read with
:func:`services`: one typed object instead of loose string keys in ``app.extensions``."""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import redis
from flask import Flask, current_app
from prometheus_client import CollectorRegistry, multiprocess

from tasks.broker.queues import RequestPublisher
from tasks.config import Settings
from tasks.gateway import readiness
from tasks.gateway.admission_queue import AdmissionQueue
from tasks.gateway.gate import Gate
from tasks.gateway.gateway import Gateway
from tasks.gateway.links import redis_client
from tasks.gateway.parts import GatewayParts
from tasks.policy.callers import RecentCallers
from tasks.policy.shedding import Door
from tasks.state.admission import Admission
from tasks.state.clock import SharedClock
from tasks.state.fleet import Fleet, FleetCache
from tasks.state.journal import Journal
from tasks.state.keys import Keys
from tasks.state.metrics import HTTP_REQUESTS, REQUEST_LATENCY, TENANT_REFUSALS, SystemCollector
from tasks.state.requests import Requests
from tasks.state.results import ResultListener
from tasks.store.adapters import AdapterCatalog, AdapterStore
from tasks.store.directory import TenantDirectory
from tasks.store.tenants import KeyStore
from tasks.store.ttl_cache import LookupCache
from webapp.door import door_from_settings
from webapp.errors import status_of
from webapp.worker import Arrivals

EXTENSION = "llmb"  # the one key in app.extensions
# broker connections an API process opens as it starts: a round's publish, and the next round's while the first
# waits for its confirm
WARM_BROKER_CONNECTIONS = 2


@dataclass(frozen=True)
class Services:
    """The process's settings and clients, each built once here (the process's composition root): Redis and
    RabbitMQ (``client``, ``publisher``), the fleet's shared clock, admission, the fleet and this process's cache
    of it, the gateway built from them, this process's view of each model's admission queue (which the door reads
    and the gateway keeps up to date), the key store and its cached directory, the LoRA adapters' registry and its
    cached catalog, the door's counter, the requests not yet got to (which the door reads and gunicorn's worker
    keeps) and the metrics registry /metrics reports."""

    settings: Settings
    client: redis.Redis
    publisher: RequestPublisher
    clock: SharedClock
    admission: Admission
    fleet: Fleet
    workers: FleetCache
    queue: AdmissionQueue
    gateway: Gateway
    keys: KeyStore
    tenants: TenantDirectory
    adapter_store: AdapterStore
    adapters: AdapterCatalog
    door: Door
    arrivals: Arrivals
    metrics: CollectorRegistry
    stopping: threading.Event = field(default_factory=threading.Event)  # ends what warm_up started to keep fresh

    @classmethod
    def from_settings(cls, settings: Settings, *, door: bool = True) -> Services:
        """``door``: the process's calls come through its door, which counts their callers for the gate (an API
        process); False: they come otherwise (llmb-jobs), and the gate counts them as they pass."""
        client = redis_client(settings)
        instance_id = uuid.uuid4().hex
        names = Keys.from_settings(settings)
        publisher = RequestPublisher(settings.broker.url, settings.request_queue, settings.broker.pool_size,
                                     settings.broker.persistent_requests, settings.broker.queue_type)
        clock = SharedClock.from_settings(settings, client)
        admission = Admission.from_settings(settings, client, instance_id)
        fleet = Fleet.from_settings(settings, client)
        # A stopping worker still serves its model: a rolling restart must not flap it to 503.
        workers = FleetCache(fleet, settings.worker.heartbeat_interval_s / 2, draining=True, wallclock=clock)
        listener = ResultListener(client, names.replies(instance_id), names.result, settings.stores.result_recheck_s)
        requests = Requests.from_settings(settings, client, status_of)
        journal = Journal(client, names, settings.stores.result_ttl_s)
        parts = GatewayParts(instance_id, client, clock, admission, requests, workers, listener, journal, publisher)
        gate = None
        if settings.admission.admit_concurrency:  # the door counts who sends what for it, or it counts them itself
            gate = Gate(settings.admission.admit_concurrency, settings.admission.door_max_delay_s,
                        callers=RecentCallers(time.monotonic) if door else None)
        queue = AdmissionQueue(settings, workers, gate)
        keys = KeyStore.from_settings(settings)
        adapter_store = AdapterStore.from_settings(settings, keys.engine)  # one pool for both tables
        arrivals = Arrivals()
        return cls(settings=settings, client=client, publisher=publisher, clock=clock, admission=admission,
                   fleet=fleet, workers=workers, queue=queue,
                   gateway=Gateway(settings, parts, queue, gate),
                   keys=keys,
                   tenants=TenantDirectory(keys, ttl_s=settings.tenants.auth_cache_s),
                   adapter_store=adapter_store,
                   adapters=AdapterCatalog.from_store(adapter_store, settings.tenants.adapter_cache_s),
                   door=door_from_settings(settings, gate, arrivals.backlog),
                   arrivals=arrivals,
                   metrics=metrics_registry(settings, fleet, admission, clock, publisher, keys))

    def warm_up(self) -> None:
        """Do, as the process starts, what its first calls would otherwise do in their first round: read the fleet
        (the door places a burst's calls by it), start the admission lease's renewal and the result listener, and
        keep the fleet's view and the index of active keys fresh from then on (:meth:`_keep_views_fresh`).
        Each is one yield to the event loop or one Redis read, and under a burst every yield waits a whole pass
        over the burst's arrivals: traced in a fresh process's first burst of 3,000, the fleet read held each
        arrival's judgement 0.2-0.35 s, and the lease and the listener held the first round 0.09 s and 0.15-0.26 s,
        while the device waited for its first batch. Redis away: the first call does it, as before."""
        try:
            self.workers.get()
        except Exception:  # only an early read: the first call tries again, and answers any error
            logging.getLogger("llmb.web").info("the fleet could not be read at start; the first call reads it")
        self.gateway.start()
        threading.Thread(target=self._keep_views_fresh, name="fresh-views", daemon=True).start()
        try:
            self.publisher.open(WARM_BROKER_CONNECTIONS)
        except Exception:  # RabbitMQ away: the first publish connects, as before
            logging.getLogger("llmb.web").info("RabbitMQ could not be reached at start; the first call connects")

    def _keep_views_fresh(self) -> None:
        """Keep what the door judges a burst's arrivals by fresh while no call comes: the fleet (read once its view
        is older than half a heartbeat) and, with keys, the index of active keys (loaded every LLMB_AUTH_CACHE_S).
        The door reads only memory, in the event loop itself: a process whose fleet view was empty at a burst (read
        at its start, before the worker was up) let every call of it through unjudged (measured: 1,094 of 1,657
        arrivals in one process, refused 1.1-1.4 s later at their turn instead of at arrival), and a key issued
        since the index's last load leaves its tenant's calls unjudged until one is looked up."""
        log = logging.getLogger("llmb.web")
        while True:
            try:
                self.workers.get()
            except Exception:  # Redis away: the view stays as last read; the calls' own reads answer the error
                log.debug("the fleet could not be read", exc_info=True)
            if self.settings.tenants.auth != "none":
                try:
                    self.tenants.refresh_index()
                except Exception:  # the database away: the index keeps its last load
                    log.debug("the key index could not be loaded", exc_info=True)
            if self.stopping.wait(self.workers.max_age_s):
                return

    def served_models(self) -> set[str]:
        """The models live workers serve (this process's cached view of the fleet)."""
        return {w.model for w in self.gateway.live_workers()}

    def ping(self) -> dict[str, object]:
        """Readiness: broker and Redis reachable, and the live workers. Raises Unavailable otherwise."""
        return readiness.ping(self.client, self.fleet, self.clock, self.publisher)


def services(app: Flask | None = None) -> Services:
    """The services of ``app``, by default the app handling the current request."""
    found = (current_app if app is None else app).extensions[EXTENSION]
    assert isinstance(found, Services), "create_app installs the services"
    return found


def metrics_registry(settings: Settings, fleet: Fleet, admission: Admission, clock: SharedClock,
                     publisher: RequestPublisher, keys: KeyStore) -> CollectorRegistry:
    """This process's view of every API process (multiprocess mode) plus the system-wide figures."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:  # a single process (tests, the Flask dev server): its own counters are the whole story
        registry.register(HTTP_REQUESTS)
        registry.register(REQUEST_LATENCY)
        registry.register(TENANT_REFUSALS)

    def depth() -> int | None:
        try:
            return publisher.queue_depth()
        except Exception:  # RabbitMQ away: leave the gauge out of this scrape
            return None

    known = LookupCache[list[str]]("tenant list", 30.0, time.monotonic, 1)  # a scrape reads the table twice a minute

    def tenants() -> list[str]:
        try:
            return known.get("all", lambda: [t.name for t in keys.list_tenants()]) or []
        except Exception:  # the database away, never read: the tenants' gauges are left out of this scrape
            return []

    registry.register(SystemCollector(settings, fleet, admission, depth, clock, tenants))
    return registry
