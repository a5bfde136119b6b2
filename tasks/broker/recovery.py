"""The batcher's side of failure handling: noticing lost workers and taking their batches back.

Every batch that must be run again travels through the durable ``<ns>.recovery`` queue, and its message is
acknowledged only once the batches that replace it are handed to workers (or its items are answered), so a
batcher that dies half way loses nothing. Two kinds of message arrive there:

- from workers: a batch the model raised on, or one whose previous runner died (the worker found out from
  the batch's claim, see :mod:`tasks.state.claims`);
- from batchers, "lost": a batch of a worker that is gone. A worker is lost when its heartbeat goes stale,
  or sooner when its batch queue has no consumer left (a killed process closes its connection and RabbitMQ
  returns its unacknowledged batches to that queue at once). Its batches are collected from this batcher's
  memory (a frozen worker still holds them) and by draining its queue; the batch's claim then says whether
  it never started (stranded: send it again), was running (died: split it), or was dealt with (skip).

The decisions are :func:`tasks.policy.isolation.plan`'s; this module does the I/O around them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from kombu import Connection, Message, Queue

from tasks.broker.celery_app import batch_of_task
from tasks.broker.queues import RETRY_POLICY
from tasks.errors import PoisonInput, RetriesExhausted
from tasks.policy.batcher import Batcher
from tasks.policy.scheduler_output import SchedulerOutput
from tasks.schema import NOT_TAKING_WORK, Batch, BatchItem, Failure, ItemResult, WorkerInfo, input_hash
from tasks.state.claims import Claims, ClaimVerdict
from tasks.state.fleet import Fleet
from tasks.state.quarantine import Quarantine
from tasks.state.results import ResultWriter
from tasks.store.ledger import BatchOutcome, ItemsOutcome, LedgerEvent, Quarantined

log = logging.getLogger("llmb.recovery")

LOST = "lost"


class Recovery:
    def __init__(self, batcher: Batcher, fleet: Fleet, claims: Claims, quarantine: Quarantine,
                 writer: ResultWriter, record: Callable[[LedgerEvent], None],
                 connection: Callable[[], Connection], queue: Queue,
                 on_poison: Callable[[], object] = lambda: None) -> None:
        self.batcher = batcher
        self.fleet = fleet
        self.claims = claims
        self.quarantine = quarantine
        self.writer = writer
        self.record = record
        self.connection = connection  # a broker connection for queue checks, draining and publishing
        self.queue = queue  # the recovery queue (tasks.broker.queues.recovery_queue)
        self.on_poison = on_poison  # counts isolated poison inputs (metrics)
        self._queues: dict[str, str] = {}  # each worker's batch queue, from the last heartbeat seen of it
        self._gone_since: dict[str, float] = {}  # workers holding our batches, missing from the fleet view
        # Workers taken back because nobody consumed their queue while their heartbeat was fresh (a consumer
        # reconnecting after a broker cut, say): no batch goes to them until their queue has a consumer again (or,
        # gone from the fleet, they are forgotten). Sent there meanwhile, a batch would be taken back at the next
        # check, and each time charged a retry. Worker id -> (its queue, since when).
        self._unconsumed: dict[str, tuple[str, float]] = {}

    # -- the recovery queue --------------------------------------------------------------------------
    def on_message(self, message: Message) -> SchedulerOutput:
        """Handle one recovery message; returns the batcher's decisions (its batches sent again, first)."""
        try:
            body = json.loads(message.body)
            batch = Batch.from_dict(body["batch"])
            kind = str(body["failure"])
        except (ValueError, KeyError, TypeError) as exc:
            log.error("dropping a malformed recovery message: %s", exc)
            message.ack()
            return SchedulerOutput()
        worker, error = str(body.get("worker", "")), str(body.get("error", ""))
        blame = str(body.get("blame") or worker)
        if kind == LOST:
            claim = self.claims.for_recovery(batch.id, str(body.get("token", batch.id)))
            if claim.verdict is ClaimVerdict.SKIP:
                message.ack()
                return SchedulerOutput()
            failure = Failure.STRANDED if claim.verdict is ClaimVerdict.STRANDED else Failure.DIED
            blame = claim.worker or worker
            self.record(BatchOutcome(batch, "reassigned" if failure is Failure.STRANDED else "died", "retrying",
                                     blame, error, finished_at=time.time()))
        else:
            failure = Failure(kind)
            if failure is Failure.DIED:
                self.record(BatchOutcome(batch, "died", "retrying", blame, error, finished_at=time.time()))
            elif failure is Failure.RETURNED:
                self.record(BatchOutcome(batch, "returned", "retrying", worker, error, finished_at=time.time()))
        decided = self.batcher.recover(batch, failure, died_on=blame)
        if decided.poison:
            self._poison(batch, failure, decided.poison, error)
        if decided.exhausted:
            text = (f"the request lost its worker more than {self.batcher.config.max_retries} times (it died or was "
                    "cut off while holding it); giving up")
            self._answer(decided.exhausted, RetriesExhausted.type, text)
            self.record(ItemsOutcome(batch.model, decided.exhausted, "exhausted", text, batch.id))
        return self.batcher.requeue(decided.batches, message.ack)

    # -- lost workers --------------------------------------------------------------------------------
    def check(self, now: float) -> list[str]:
        """Find lost workers and send their batches to the recovery queue; returns their ids.

        A worker is lost when its heartbeat is stale; when it has batches of ours but nobody consumes its
        queue (a killed process; not while it is draining, which stops consuming on purpose, nor while it is
        starting, which consumes them once its consumer is up); or when it has
        batches of ours and is gone from the fleet view (it stopped, or another batcher found it lost).
        """
        workers = {w.id: w for w in self.fleet.all()}
        self._queues.update({wid: w.queue for wid, w in workers.items()})
        lost = {wid for wid, w in workers.items() if now - w.heartbeat_at > self.fleet.stale_after_s}
        ours = {wid for wid, _, _ in self.batcher.in_flight.values()}
        # Gone for half a staleness period: not just a Redis restart that emptied the fleet view for a beat.
        for wid in ours - workers.keys():
            self._gone_since.setdefault(wid, now)
        self._gone_since = {wid: t for wid, t in self._gone_since.items() if wid in ours and wid not in workers}
        lost |= {wid for wid, t in self._gone_since.items() if now - t >= self.fleet.stale_after_s / 2}
        busy = {wid for wid in ours - lost if wid in workers and workers[wid].state not in NOT_TAKING_WORK}
        if busy or self._unconsumed:
            with self.connection() as conn:
                unconsumed = {wid for wid in busy if _consumers(conn, workers[wid].queue) == 0}
                self._unconsumed = {wid: (queue, since) for wid, (queue, since) in self._unconsumed.items()
                                    if (wid in workers or now - since < self.fleet.stale_after_s)
                                    and _consumers(conn, queue) == 0}
            self._unconsumed.update({wid: (workers[wid].queue, now) for wid in unconsumed})
            lost |= unconsumed
        for wid in lost:
            seen = workers.get(wid)
            self.take_back(wid, self._queues.get(wid), seen.heartbeat_at if seen is not None else None)
        return sorted(lost)

    def routable(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """The workers batches may go to: not those whose queue nobody consumed at the last checks."""
        return [w for w in workers if w.id not in self._unconsumed] if self._unconsumed else workers

    def take_back(self, worker_id: str, queue: str | None, seen_at: float | None = None) -> None:
        """Publish every batch the worker holds to the recovery queue (those this batcher sent it, and what is
        left in its queue when the queue is known), then forget the worker. Each batch is forgotten only once
        it is published (and a queued one acknowledged only then): a failure half way leaves the rest for the
        next check. Its heartbeat (``seen_at``: the one judged; None: it was gone) leaves the fleet view only if
        no newer one replaced it: a worker restarted under the same id may have beaten meanwhile, and removing
        that beat hid the only worker of a model from the API processes (a rollout's calls to it answered 404)."""
        log.warning("worker %s is lost (no heartbeat, gone, or nobody consumes %s); taking its batches back",
                    worker_id, queue or "its queue")
        with self.connection() as conn:
            producer = conn.Producer()
            publish = conn.ensure(producer, producer.publish, **RETRY_POLICY)

            def send_back(batch: Batch) -> None:
                publish({"batch": batch.to_dict(), "failure": LOST, "worker": worker_id,
                         "error": f"worker {worker_id} was lost", "token": uuid.uuid4().hex},
                        exchange="", routing_key=self.queue.name, declare=[self.queue], serializer="json",
                        delivery_mode=2)

            for batch in self.batcher.held_by(worker_id):
                send_back(batch)
                self.batcher.forget_in_flight(batch.id)
            channel = conn.channel()
            try:
                while queue and (message := channel.basic_get(queue, no_ack=False)) is not None:
                    queued = batch_of_task(message.body)
                    if queued is not None:
                        send_back(queued)
                    channel.basic_ack(message.delivery_tag)
            except Exception as exc:  # a queue that is gone has nothing to drain
                log.debug("draining %s stopped: %s", queue, exc)
            finally:
                _close(channel)
        self.batcher.worker_lost(worker_id)
        if seen_at is not None:
            self.fleet.leave(worker_id, seen_at)
        self._queues.pop(worker_id, None)
        self._gone_since.pop(worker_id, None)

    # -- answering what cannot be run ----------------------------------------------------------------
    def _poison(self, batch: Batch, failure: Failure, items: list[BatchItem], error: str) -> None:
        how = ("killed every worker that ran it" if failure is Failure.DIED
               else f"makes the model fail ({error})")
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
    with contextlib.suppress(Exception):  # closing a channel the broker already closed
        channel.close()
