"""What every route of one API process shares, built once by :func:`webapp.create_app` and read with
:func:`services`: one typed object instead of loose string keys in ``app.extensions``."""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

from flask import Flask, current_app
from prometheus_client import CollectorRegistry, multiprocess

from tasks.broker.queues import RequestPublisher
from tasks.config import Settings
from tasks.gateway.gate import Gate
from tasks.gateway.gateway import Gateway
from tasks.gateway.links import redis_client
from tasks.policy.shedding import Door
from tasks.state.metrics import HTTP_REQUESTS, REQUEST_LATENCY, TENANT_REFUSALS, SystemCollector
from tasks.store.directory import TenantDirectory
from tasks.store.tenants import KeyStore
from tasks.store.ttl_cache import LookupCache
from webapp.door import door_from_settings

EXTENSION = "llmb"  # the one key in app.extensions


@dataclass(frozen=True)
class Services:
    """The process's settings and clients: the gateway (Redis, RabbitMQ), the key store and its cached
    directory, the door's counter and the metrics registry /metrics reports."""

    settings: Settings
    gateway: Gateway
    keys: KeyStore
    tenants: TenantDirectory
    door: Door
    metrics: CollectorRegistry

    @classmethod
    def from_settings(cls, settings: Settings) -> Services:
        client = redis_client(settings)
        publisher = RequestPublisher(settings.broker.url, settings.request_queue, settings.broker.pool_size,
                                     settings.broker.persistent_requests, settings.broker.queue_type)
        keys = KeyStore.from_settings(settings)
        gate = Gate(settings.admission.admit_concurrency,
                    settings.admission.door_max_delay_s) if settings.admission.admit_concurrency else None
        gateway = Gateway(settings, client, publisher, instance_id=uuid.uuid4().hex, gate=gate)
        return cls(settings=settings,
                   gateway=gateway,
                   keys=keys,
                   tenants=TenantDirectory(keys, ttl_s=settings.tenants.auth_cache_s),
                   door=door_from_settings(settings, gate),
                   metrics=metrics_registry(settings, gateway, publisher, keys))


def services(app: Flask | None = None) -> Services:
    """The services of ``app``, by default the app handling the current request."""
    found = (current_app if app is None else app).extensions[EXTENSION]
    assert isinstance(found, Services), "create_app installs the services"
    return found


def metrics_registry(settings: Settings, gateway: Gateway, publisher: RequestPublisher,
                     keys: KeyStore) -> CollectorRegistry:
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

    registry.register(SystemCollector(settings, gateway.fleet, gateway.admission, depth, gateway.clock, tenants))
    return registry
