"""What a gateway works with, built once by its process's composition root (:mod:`webapp.services` for an API
process, :mod:`tasks.cli.main` for the admin CLI) and handed to it: the gateway builds no client of its own, and
nothing reads its parts back through it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis

from tasks.broker.queues import RequestPublisher
from tasks.state.admission import Admission
from tasks.state.fleet import FleetCache
from tasks.state.journal import Journal
from tasks.state.requests import Requests
from tasks.state.results import ResultListener


@dataclass(frozen=True)
class GatewayParts:
    """The Redis and RabbitMQ side of a gateway. ``clock``: the fleet's shared clock (deadlines sent to batchers
    and workers, heartbeats read); ``workers``: the live fleet as this process caches it; ``listener``: the one
    result listener, on this process's reply channel; ``client``: what cancellations are published on."""

    instance_id: str  # this process, as its admissions, lease and replies name it
    client: redis.Redis
    clock: Callable[[], float]
    admission: Admission
    requests: Requests
    workers: FleetCache
    listener: ResultListener
    journal: Journal
    publisher: RequestPublisher
