"""The gateway's two services: the API process's Redis client, and for each of Redis and RabbitMQ the one
translation of its failures into what the caller is told: 429 (overloaded) when this process is what is short
(its pool of connections stayed taken), 503 (unavailable) when the service is away."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis
from amqp.exceptions import AMQPError
from kombu.exceptions import KombuError

from tasks.broker.queues import PublisherBusy, PublishTimeout
from tasks.config import Settings
from tasks.errors import BatchingError, Overloaded, Unavailable
from tasks.schema import WorkerInfo
from tasks.state import connect
from tasks.state.connect import PoolExhausted
from tasks.state.fleet import FleetCache

T = TypeVar("T")

BROKER_ERRORS = (KombuError, AMQPError, OSError)
PUBLISH_ERRORS = (PublisherBusy, *BROKER_ERRORS)  # what publishing a request may raise (PublishTimeout is an OSError)
REDIS_TIMEOUT_S = 5.0  # an API process's Redis commands: longest wait for an answer


def redis_client(settings: Settings) -> redis.Redis:
    """The Redis client of an API process: one bounded pool shared by all of its waiting callers (a plain Redis
    or the master behind Sentinel, as ``LLMB_REDIS_URL`` says); a caller that waits 5 s for a connection gets
    :class:`PoolExhausted`."""
    return connect.redis_client(settings, max_connections=settings.stores.redis_pool_size, pool_timeout_s=5,
                                socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=2)


def overloaded(exc: Exception) -> Overloaded:
    """This API process, not the service behind it, is short of connections."""
    return Overloaded(f"this API process is overloaded ({exc}); retry in a moment",
                      retry_after_s=1)


def redis_refusal(exc: redis.RedisError, during: str = "", *, busy_is_overload: bool = True) -> BatchingError:
    """What a caller is told when a Redis command failed: 429 when this process's pool stayed taken
    (unless ``busy_is_overload`` is off: the wait for results and readiness say 503 either way), else 503,
    Redis unreachable (``during``: what was being done, e.g. " while streaming")."""
    if busy_is_overload and isinstance(exc, PoolExhausted):
        return overloaded(exc)
    return Unavailable(f"Redis is unreachable{during}: {exc}")


def redis_call(command: Callable[[], T]) -> T:
    """A Redis command of the request path, its failure translated by :func:`redis_refusal` (and raised)."""
    try:
        return command()
    except redis.RedisError as exc:
        raise redis_refusal(exc) from None


def live_workers(workers: FleetCache, fresh: bool = False) -> list[WorkerInfo]:
    """The live fleet from this process's cache of it (``fresh``: read it now), a Redis failure translated."""
    try:
        return workers.get(fresh)
    except redis.RedisError as exc:
        raise redis_refusal(exc) from None


def broker_refusal(exc: Exception) -> BatchingError:
    """What a caller is told when publishing to (or pinging) RabbitMQ failed: 503 for a confirm that did not
    come in time or a broker that cannot be reached, 429 when this process's broker connections stayed busy."""
    if isinstance(exc, PublishTimeout):
        return Unavailable(f"{exc} (is it blocked by a memory or disk alarm?); retry later")
    if isinstance(exc, PublisherBusy):
        return overloaded(exc)
    return Unavailable(f"RabbitMQ is unreachable: {exc}")
