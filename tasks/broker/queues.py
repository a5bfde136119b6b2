"""Our own RabbitMQ queues (the batch queues are Celery's), and the publisher API processes feed requests with.

- ``<ns>.requests``: inference requests, from API processes to batchers.
- ``<ns>.recovery``: batches that came back from a worker (the model raised, or a worker found that the
  previous holder of a batch died running it), from workers to batchers.


A request message carries the calls an API process admitted in one round (:mod:`tasks.gateway.rounds`): one
or more, each with all of its items. It is published with publisher confirms, so that a return from
:meth:`RequestPublisher.publish` means RabbitMQ has every call in it, and expires in the broker at the last of
their deadlines, so work nobody waits for is dropped even if no batcher is running (a batcher drops each
expired call of a message it gets).
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence

from kombu import Connection, Exchange, Queue
from kombu.common import maybe_declare
from kombu.exceptions import LimitExceeded
from kombu.pools import ProducerPool

from tasks.schema import InferenceRequest

RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
PUBLISH_ATTEMPTS = 3  # connection errors while publishing a request: reconnect and try again, within the budget


class PublishTimeout(TimeoutError):
    """Raised when the broker does not confirm a publish in time (blocked by an alarm, or unreachable)."""


class PublisherBusy(Exception):
    """Raised when no pooled broker connection came free within the publish budget (this process is
    overloaded, not the broker down). While publishes go unconfirmed (an alarm), the connections are busy
    waiting for the broker: that wait is a :class:`PublishTimeout` (503), as theirs is."""


# One batcher consumes at a time; the others are hot standbys that RabbitMQ switches to the moment the active
# one's connection closes (its unacknowledged requests go to the next, in order). So however many batchers run,
# one sees every request: tenant fairness, priority and the per-worker batch limit hold as with one.
SINGLE_ACTIVE = {"x-single-active-consumer": True}
QUEUE_TYPES = ("classic", "quorum")


def queue_arguments(queue_type: str) -> dict[str, object]:
    """The declaration arguments of a queue of this type (``LLMB_QUEUE_TYPE``): quorum queues are replicated
    across a RabbitMQ cluster (Raft), classic ones live on one node."""
    if queue_type not in QUEUE_TYPES:
        raise ValueError(f"LLMB_QUEUE_TYPE={queue_type!r}: expected one of {', '.join(QUEUE_TYPES)}")
    return {} if queue_type == "classic" else {"x-queue-type": queue_type}


def request_queue(name: str, queue_type: str = "classic") -> Queue:
    """Declared identically by publishers and the batcher (a mismatch would make RabbitMQ refuse one)."""
    return Queue(name, durable=True, routing_key=name, queue_arguments={**SINGLE_ACTIVE, **queue_arguments(queue_type)})


def recovery_queue(name: str, queue_type: str = "classic") -> Queue:
    return Queue(name, durable=True, routing_key=name, queue_arguments={**SINGLE_ACTIVE, **queue_arguments(queue_type)})


def request_body(requests: Sequence[InferenceRequest]) -> str:
    """A request message's body: the calls of one round."""
    return json.dumps({"requests": [r.to_dict() for r in requests]})


def requests_of(body: str | bytes) -> list[InferenceRequest]:
    """The calls in a request message (also the one-call body that API processes before rounds published, so a
    rolling upgrade loses nothing). Raises ValueError when it is malformed."""
    try:
        decoded = json.loads(body)
    except ValueError as exc:  # JSONDecodeError and bad UTF-8 alike
        raise ValueError(f"not a request message (not JSON: {exc})") from None
    try:
        if isinstance(decoded, dict) and "requests" in decoded:
            requests = [InferenceRequest.from_dict(r) for r in decoded["requests"]]
        else:
            requests = [InferenceRequest.from_dict(decoded)]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a request message: {exc!r}") from None
    if not requests:
        raise ValueError("a request message without requests")
    return requests


class RequestPublisher:
    """Publishes from many greenlets or threads: each publish borrows a connection from a bounded pool."""

    def __init__(self, broker_url: str, queue_name: str, pool_size: int, persistent: bool = True,
                 queue_type: str = "classic") -> None:
        self.queue = request_queue(queue_name, queue_type)
        self.persistent = persistent
        self.connection = Connection(
            broker_url, connect_timeout=2, transport_options={"confirm_publish": True}
        )
        self.pool = self.connection.Pool(limit=pool_size)
        self.producers = ProducerPool(self.pool, limit=pool_size)
        self._silent = False  # the last publish to end went unconfirmed (an alarm): the broker is silent

    def publish(self, requests: Sequence[InferenceRequest], timeout_s: float) -> None:
        """Publish these calls as one message and wait for the broker's confirm, for at most ``timeout_s`` in all
        (waiting for a pooled connection, reconnecting and the confirm included). Raises kombu/amqp/OS errors if
        it cannot; a :class:`PublishTimeout` when the broker does not confirm in time (a memory or disk alarm
        blocks publishers without a word)."""
        ttl_s = max(max(r.deadline - r.accepted_at for r in requests), 0.001)
        give_up = time.monotonic() + timeout_s
        body = request_body(requests)
        for attempt in range(PUBLISH_ATTEMPTS):
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                break
            try:
                acquired = self.producers.acquire(block=True, timeout=remaining)
            except LimitExceeded:
                if self._silent:  # the connections wait for confirms that do not come
                    raise PublishTimeout(f"RabbitMQ did not confirm requests within {timeout_s:.1f} s") from None
                raise PublisherBusy(f"all {self.pool.limit} broker connections of this API process stayed busy "
                                    f"for {timeout_s:.1f} s") from None
            with acquired as producer:
                remaining = give_up - time.monotonic()  # the wait for a connection came out of the budget
                if remaining <= 0:
                    break
                try:
                    producer.publish(
                        body, exchange="", routing_key=self.queue.name, declare=[self.queue],
                        content_type="application/json", content_encoding="utf-8",
                        delivery_mode=2 if self.persistent else 1, expiration=ttl_s,
                        correlation_id=requests[0].id, headers={"requests": len(requests)},
                        timeout=remaining, confirm_timeout=remaining)
                    self._silent = False
                    return
                except TimeoutError:
                    # a confirm may still come, and would be taken for the next message's: drop the connection
                    self._silent = True
                    producer.connection.collect()
                    break
                except producer.connection.recoverable_connection_errors:
                    producer.connection.collect()  # reconnect on the next attempt
                    if attempt == PUBLISH_ATTEMPTS - 1:
                        raise
            time.sleep(min(0.2 * attempt, max(0.0, give_up - time.monotonic())))
        raise PublishTimeout(f"RabbitMQ did not confirm the request within {timeout_s:.1f} s")

    def open(self, count: int, timeout_s: float = 2.0) -> None:
        """Open ``count`` of the pool's connections now, each with its channel in confirm mode and the request
        queue declared, as a process starts: a publish on a new connection is four round trips before its own
        (connect, channel, confirms, declare), and a burst's first rounds each waited a turn of the event loop
        at every one of them (0.1-0.2 s, traced) while the device sat idle. Raises what connecting raises."""
        held = []
        try:
            for _ in range(min(count, self.pool.limit)):
                held.append(self.producers.acquire(block=True, timeout=timeout_s))
            for producer in held:
                producer.connection.ensure_connection(max_retries=0)  # once: RabbitMQ away raises at once
                maybe_declare(self.queue, producer.channel)
        finally:
            for producer in held:
                producer.release()

    def queue_depth(self) -> int:
        """Requests waiting in RabbitMQ (not yet delivered to a batcher)."""
        with self.pool.acquire(block=True, timeout=5) as conn:
            _, count, _ = conn.default_channel.queue_declare(self.queue.name, passive=True)
            return int(count)

    def ping(self) -> None:
        """Raise if RabbitMQ cannot be reached."""
        with self.pool.acquire(block=True, timeout=5) as conn:
            conn.ensure_connection(max_retries=1)

    def close(self) -> None:
        self.producers.force_close_all()
        self.pool.force_close_all()


def fleet_exchange(namespace: str) -> Exchange:
    """Fanout on which workers announce each batch they start and finish; every batcher binds its own queue.

    Announcements are transient: one lost only delays the scheduler (see Scheduler.forget_after_s).
    """
    return Exchange(f"{namespace}.fleet", type="fanout", durable=False, delivery_mode=1)
