"""The batcher's side of failure handling: noticing lost workers and taking their batches back.

Every batch that must be run again travels through the durable ``<ns>.recovery`` queue, and its message is
acknowledged only once the batches that replace it are handed to workers (or its items are answered), so a
batcher that dies half way loses nothing. Two kinds of message arrive there:

- from workers: a batch the model raised on, or one whose previous runner died (the worker found out from
  the batch's claim, see :mod:`tasks.claims`);
- from batchers, "lost": a batch of a worker that is gone. A worker is lost when its heartbeat goes stale,
  or sooner when its batch queue has no consumer left (a killed process closes its connection and RabbitMQ
  returns its unacknowledged batches to that queue at once). Its batches are collected from this batcher's
  memory (a frozen worker still holds them) and by draining its queue; the batch's claim then says whether
  it never started (stranded: send it again), was running (died: split it), or was dealt with (skip).

The decisions are :func:`tasks.isolation.plan`'s; this module does the I/O around them.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from kombu import Connection, Message

from tasks.batcher import Batcher
from tasks.claims import Claims
from tasks.errors import PoisonInput, RetriesExhausted
from tasks.fleet import Fleet, WorkerInfo
from tasks.ledger import BatchOutcome, ItemsOutcome, LedgerEvent, Quarantined
from tasks.quarantine import Quarantine
from tasks.queues import RETRY_POLICY, recovery_queue
from tasks.results import ResultWriter
from tasks.schema import Batch, BatchItem, Failure, ItemResult, input_hash

log = logging.getLogger("llmb.recovery")

LOST = "lost"


class Recovery:
    def __init__(self, batcher: Batcher, fleet: Fleet, claims: Claims, quarantine: Quarantine,
                 writer: ResultWriter, record: Callable[[LedgerEvent], None],
                 connection: Callable[[], Connection], queue_name: str,
                 on_poison: Callable[[], object] = lambda: None) -> None:
        self.batcher = batcher
        self.fleet = fleet
        self.claims = claims
        self.quarantine = quarantine
        self.writer = writer
        self.record = record
        self.connection = connection  # a broker connection for queue checks, draining and publishing
        self.queue = recovery_queue(queue_name)
        self.on_poison = on_poison  # counts isolated poison inputs (metrics)

    # -- the recovery queue --------------------------------------------------------------------------
    def on_message(self, message: Message) -> float | None:
        """Handle one recovery message; returns the batcher's next poll delay."""
        try:
            body = json.loads(message.body)
            batch = Batch.from_dict(body["batch"])
            kind = str(body["failure"])
        except (ValueError, KeyError, TypeError) as exc:
            log.error("dropping a malformed recovery message: %s", exc)
            message.ack()
            return None
        worker, error = body.get("worker"), str(body.get("error", ""))
        if kind == LOST:
            verdict = self.claims.for_recovery(batch.id, str(body.get("token", batch.id)))
            if verdict == "skip":
                message.ack()
                return None
            failure = Failure.STRANDED if verdict == "stranded" else Failure.DIED
            self.record(BatchOutcome(batch, "reassigned" if failure is Failure.STRANDED else "died", "retrying",
                                     worker, error, finished_at=time.time()))
        else:
            failure = Failure(kind)
            if failure is Failure.DIED:
                self.record(BatchOutcome(batch, "died", "retrying", worker, error, finished_at=time.time()))
        decided = self.batcher.recover(batch, failure)
        if decided.poison:
            self._poison(batch, failure, decided.poison, error)
        if decided.exhausted:
            text = f"the request lost its worker {self.batcher.max_retries} times before running; giving up"
            self._answer(decided.exhausted, RetriesExhausted.type, text)
            self.record(ItemsOutcome(batch.model, decided.exhausted, "exhausted", text, batch.id))
        return self.batcher.requeue(decided.batches, message.ack)

    # -- lost workers --------------------------------------------------------------------------------
    def check(self, now: float) -> list[str]:
        """Find lost workers and send their batches to the recovery queue; returns their ids."""
        workers = {w.id: w for w in self.fleet.all()}
        lost = {wid for wid, w in workers.items() if now - w.heartbeat_at > self.fleet.stale_after_s}
        busy = {wid for wid, _, _ in self.batcher.in_flight.values()} - lost
        if busy:
            with self.connection() as conn:
                lost |= {wid for wid in busy if wid in workers and _consumers(conn, workers[wid].queue) == 0}
        for wid in lost:
            self.take_back(workers[wid])
        return sorted(lost)

    def take_back(self, worker: WorkerInfo) -> None:
        log.warning("worker %s is lost (no heartbeat, or nobody consumes %s); taking its batches back",
                    worker.id, worker.queue)
        self.fleet.leave(worker.id)
        with self.connection() as conn:
            producer = conn.Producer()
            publish = conn.ensure(producer, producer.publish, **RETRY_POLICY)

            def send_back(batch: Batch) -> None:
                publish({"batch": batch.to_dict(), "failure": LOST, "worker": worker.id,
                         "error": f"worker {worker.id} was lost", "token": uuid.uuid4().hex},
                        exchange="", routing_key=self.queue.name, declare=[self.queue], serializer="json",
                        delivery_mode=2)

            for batch in self.batcher.worker_lost(worker.id):
                send_back(batch)
            channel = conn.channel()
            try:
                while (message := channel.basic_get(worker.queue, no_ack=False)) is not None:
                    queued = _batch_of(message.body)
                    if queued is not None:
                        send_back(queued)
                    channel.basic_ack(message.delivery_tag)
            except Exception as exc:  # a queue that is gone has nothing to drain
                log.debug("draining %s stopped: %s", worker.queue, exc)
            finally:
                _close(channel)

    # -- answering what cannot be run ----------------------------------------------------------------
    def _poison(self, batch: Batch, failure: Failure, items: list[BatchItem], error: str) -> None:
        how = "kills its worker" if failure is Failure.DIED else f"makes the model fail ({error})"
        for item in items:
            digest = input_hash(batch.model, item.input)
            text = (f"this input {how} even when run alone; it is quarantined (hash {digest}) and refused "
                    f"until an operator runs `llmb-admin quarantine release {digest}`")
            try:
                self.quarantine.add(digest, model=batch.model, reason=text, batch_id=batch.id,
                                    request_id=item.request_id)
            except redis.RedisError as exc:
                log.error("could not quarantine %s: %s", digest, exc)
            self._answer([item], PoisonInput.type, text)
            self.on_poison()
            self.record(Quarantined(digest, batch.model, text, batch.id, item))
            log.warning("poison input isolated in batch %s: request %s, hash %s", batch.id, item.request_id,
                        digest, extra={"batch_id": batch.id, "request_id": item.request_id})
        self.record(ItemsOutcome(batch.model, items, "poison", error, batch.id))

    def _answer(self, items: list[BatchItem], error_type: str, text: str) -> None:
        self.writer.write([(i, ItemResult(error=error_type, message=text)) for i in items])


def _consumers(conn: Connection, queue: str) -> int:
    channel = conn.channel()
    try:
        _, _, consumers = channel.queue_declare(queue, passive=True)
        return int(consumers)
    except Exception:  # no such queue: nobody consumes it
        return 0
    finally:
        _close(channel)


def _close(channel: Any) -> None:
    try:
        channel.close()
    except Exception:  # closing a channel the broker already closed
        pass


def _batch_of(body: bytes | str) -> Batch | None:
    """The batch inside a Celery task message (protocol 2: [args, kwargs, embed])."""
    try:
        return Batch.from_dict(json.loads(body)[0][0])
    except (ValueError, KeyError, IndexError, TypeError):
        log.error("a message in a lost worker's queue is not a batch task; dropping it")
        return None
