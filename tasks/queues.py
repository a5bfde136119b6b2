"""Our own RabbitMQ queues (the batch queues are Celery's), and the publisher API processes feed requests with.

- ``<ns>.requests``: inference requests, from API processes to batchers.
- ``<ns>.recovery``: batches that came back from a worker (the model raised, or a worker found that the
  previous holder of a batch died running it), from workers to batchers.


One message per HTTP call (all of its items), published with publisher confirms so that a 200 from
:meth:`RequestPublisher.publish` means RabbitMQ has the request. The message also expires in the broker at
the caller's deadline, so work nobody waits for is dropped even if no batcher is running.
"""
from __future__ import annotations

import json

from kombu import Connection, Queue
from kombu.pools import ProducerPool

from tasks.schema import InferenceRequest

RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


def request_queue(name: str) -> Queue:
    """Declared identically by publishers and the batcher (a mismatch would make RabbitMQ refuse one)."""
    return Queue(name, durable=True, routing_key=name)


def recovery_queue(name: str) -> Queue:
    return Queue(name, durable=True, routing_key=name)


class RequestPublisher:
    """Publishes from many greenlets or threads: each publish borrows a connection from a bounded pool."""

    def __init__(self, broker_url: str, queue_name: str, pool_size: int, persistent: bool = True) -> None:
        self.queue = request_queue(queue_name)
        self.persistent = persistent
        self.connection = Connection(
            broker_url, connect_timeout=2, transport_options={"confirm_publish": True}
        )
        self.pool = self.connection.Pool(limit=pool_size)
        self.producers = ProducerPool(self.pool, limit=pool_size)

    def publish(self, request: InferenceRequest) -> None:
        """Publish and wait for the broker's confirm; raises kombu/amqp/OS errors if it cannot."""
        ttl_s = max(request.deadline - request.accepted_at, 0.001)
        with self.producers.acquire(block=True, timeout=5) as producer:
            producer.connection.ensure(producer, producer.publish, **RETRY_POLICY)(
                json.dumps(request.to_dict()),
                exchange="",
                routing_key=self.queue.name,
                declare=[self.queue],
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2 if self.persistent else 1,
                expiration=ttl_s,
                correlation_id=request.id,
                headers={"tenant": request.tenant, "model": request.model},
            )

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
