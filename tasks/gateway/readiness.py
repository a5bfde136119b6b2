"""Readiness (``/readyz``): Redis and RabbitMQ reachable, and at least one GPU worker alive."""
from __future__ import annotations

from collections.abc import Callable

import redis

from tasks.broker.queues import RequestPublisher
from tasks.errors import Unavailable
from tasks.gateway.links import BROKER_ERRORS, broker_refusal, redis_refusal
from tasks.state.fleet import Fleet


def ping(client: redis.Redis, fleet: Fleet, clock: Callable[[], float],
         publisher: RequestPublisher) -> dict[str, object]:
    """The live workers, once Redis and the broker answered; Unavailable otherwise."""
    try:
        client.ping()
        workers = fleet.live(clock())
    except redis.RedisError as exc:
        raise redis_refusal(exc, busy_is_overload=False) from None
    try:
        publisher.ping()
    except BROKER_ERRORS as exc:
        raise broker_refusal(exc) from None
    if not workers:
        raise Unavailable("no GPU worker is alive (no heartbeat in the last "
                          f"{fleet.stale_after_s:g} s); start one with `gpu-worker --gpu 0`")
    return {"workers": len(workers), "models": sorted({w.model for w in workers})}
