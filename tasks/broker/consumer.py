"""The batcher process: a Celery worker whose only job is a bootstep consuming the request queue.

The bootstep is glue between kombu and :class:`tasks.policy.batcher.Batcher`: it decodes messages at the edge,
refreshes the fleet view from Redis, and carries out what the batcher decides (a
:class:`~tasks.policy.scheduler_output.SchedulerOutput`): publishes each batch as a Celery task to the chosen
worker's own queue, with publisher confirms, records dropped items in the ledger, acknowledges the request
messages so resolved, and arms one timer on the worker's event loop for the next flush. It also
consumes the workers' batch announcements and the recovery queue (:mod:`tasks.broker.recovery`), and checks for
lost workers at every tick.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import click
import redis
from celery import Celery, bootsteps, signals
from kombu import Consumer, Message, Queue

from tasks import tracing
from tasks.broker.celery_app import RUN_BATCH, make_celery, settings_of
from tasks.broker.queues import RETRY_POLICY, fleet_exchange, recovery_queue, request_queue, requests_of
from tasks.broker.recovery import Recovery
from tasks.config import Settings
from tasks.heap import settle
from tasks.logs import setup_logging
from tasks.policy.batcher import Batcher, BatcherConfig
from tasks.policy.scheduler_output import Drop, SchedulerOutput, Send
from tasks.schema import Batch, BatchEvent, WorkerInfo
from tasks.state.admission import Admission
from tasks.state.claims import Claims
from tasks.state.clock import SharedClock
from tasks.state.connect import redis_client
from tasks.state.fleet import Fleet, FleetCache
from tasks.state.metrics import Stats
from tasks.state.quarantine import Quarantine, QuarantineSync
from tasks.state.results import ResultWriter
from tasks.store.ledger import ItemsOutcome
from tasks.store.ledger_writer import LedgerWriter

log = logging.getLogger("llmb.batcher")


class BatchingStep(bootsteps.ConsumerStep):
    """Consumes ``<namespace>.requests`` with a prefetch window as deep as the batcher's buffer."""

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.app: Celery = c.app
        self.settings = settings_of(c.app)
        s = self.settings
        client = redis_client(s, socket_timeout=2, socket_connect_timeout=2)
        self.stats = stats = Stats.from_settings(s, client)
        self.clock = SharedClock.from_settings(s, client)  # deadlines and heartbeats are on it, whatever host set them
        self.fleet = Fleet.from_settings(s, client)
        self.workers = FleetCache(self.fleet, s.worker.heartbeat_interval_s / 2, wallclock=self.clock)
        self.ledger = LedgerWriter.from_settings(s, on_drop=lambda n: stats.add("ledger_dropped", n))
        self.batcher = Batcher(BatcherConfig.from_settings(s), self._live_workers, wallclock=self.clock,
                               stamp=tracing.stamp_batch if tracing.enabled() else None)
        quarantine = Quarantine.from_settings(s, client)
        self.admission = Admission.from_settings(s, client)  # reaps what lost API processes had admitted
        self.quarantine_sync = QuarantineSync(quarantine, self.ledger.ledger)  # the ledger is the durable copy
        self.recovery = Recovery(
            self.batcher, self.fleet, Claims.from_settings(s, client), quarantine,
            ResultWriter.from_settings(s, client), self.ledger.record,
            lambda: self.app.pool.acquire(block=True, timeout=10), recovery_queue(s.recovery_queue,
                                                                                  s.broker.queue_type),
            on_poison=lambda: stats.add("poison_inputs"))
        self._timer: Any = None
        self._timer_eta = float("inf")
        self._tick: Any = None
        self._c = c

    def get_consumers(self, channel: Any) -> list[Consumer]:
        s = self.settings
        announcements = Queue(f"{s.broker.namespace}.fleet.{uuid.uuid4().hex}",
                              exchange=fleet_exchange(s.broker.namespace),
                              exclusive=True, auto_delete=True, durable=False)
        return [
            Consumer(channel, queues=[request_queue(s.request_queue, s.broker.queue_type)], on_message=self._on_message,
                     prefetch_count=s.batcher.prefetch, accept=["json"]),
            Consumer(channel, queues=[announcements], on_message=self._on_batch_event, no_ack=True,
                     accept=["json"]),
            Consumer(channel, queues=[self.recovery.queue], on_message=self._on_recovery,
                     prefetch_count=s.batcher.prefetch, accept=["json"]),
        ]

    def start(self, c: Any) -> None:
        super().start(c)
        self._tick = c.timer.call_repeatedly(self.settings.worker.heartbeat_interval_s / 2, self._on_tick)
        s = self.settings
        log.info("batcher consuming %s (max_batch_size=%d, wait_mode=%s, max_wait %g ms, prefetch=%d)",
                 s.request_queue, s.batcher.max_batch_size, s.batcher.wait_mode, s.batcher.max_wait_s * 1000,
                 s.batcher.prefetch)
        if s.batcher.prefetch < s.admission.cap:
            log.warning("LLMB_BATCHER_PREFETCH (%d) is below LLMB_ADMISSION_CAP (%d): under a flood, other "
                        "tenants' requests can wait behind it in the request queue where fairness cannot see "
                        "them", s.batcher.prefetch, s.admission.cap)

    def stop(self, c: Any) -> None:
        self._cancel_timers()
        dropped = self.batcher.discard_all()  # unacknowledged: RabbitMQ redelivers them
        if dropped:
            log.info("consumer stopping: %d buffered items left to the broker for redelivery", dropped)
        super().stop(c)

    def shutdown(self, c: Any) -> None:
        self._cancel_timers()
        self.batcher.discard_all()
        self.ledger.close()
        super().shutdown(c)

    # -- kombu callbacks -----------------------------------------------------------------------------
    def _on_message(self, message: Message) -> None:
        try:
            requests = requests_of(message.body)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            log.error("dropping malformed request message: %s", exc)
            message.ack()
            return
        self._carry_out(self.batcher.add_message(requests, message.ack))

    def _on_batch_event(self, message: Message) -> None:
        try:
            event = BatchEvent.from_dict(json.loads(message.body))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed fleet announcement")
            return
        if event.event == "started":
            idle_s = None if event.idle_ms is None else event.idle_ms / 1000
            self._carry_out(self.batcher.started(event.worker, event.batch_id, event.at, idle_s))
        else:
            run_s = None if event.run_ms is None else event.run_ms / 1000
            self._carry_out(self.batcher.finished(event.worker, event.batch_id, run_s, event.tokens))

    def _on_recovery(self, message: Message) -> None:
        self._carry_out(self.recovery.on_message(message))

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_eta = float("inf")
        self._carry_out(self.batcher.poll())

    def _on_tick(self) -> None:
        """Periodic: take back lost workers' batches, restore a quarantine Redis lost, release what lost API
        processes had admitted, refresh the fleet, retry held batches."""
        self.quarantine_sync.tick()
        try:
            self.recovery.check(self.clock())
        except Exception as exc:  # Redis or the broker is away: try again at the next tick
            log.warning("could not check the fleet for lost workers: %s", exc)
        try:
            self.admission.reap()
        except redis.RedisError as exc:
            log.warning("could not release what lost API processes had admitted: %s", exc)
        self.batcher.forget_stale_in_flight(older_than_s=600)
        self.workers.invalidate()
        self._carry_out(self.batcher.retry_held())

    # -- carrying out the batcher's decisions --------------------------------------------------------
    def _carry_out(self, out: SchedulerOutput) -> None:
        """Publish the batches decided, in order, then record the drops and acknowledge the messages resolved. A
        batch the broker refuses goes back to the batcher with the steps after it (it keeps their batches for the
        next retry); the drops among them stand. Publishing first leaves nothing decided but not published if an
        acknowledgement fails (the channel is gone)."""
        steps, next_poll_s = out.steps, out.next_poll_s
        for i, step in enumerate(steps):
            if isinstance(step, Send) and not self._publish(step):
                back = self.batcher.unsent(steps[i:])
                steps, next_poll_s = (*steps[:i], *back.steps), back.next_poll_s
                break
        for step in steps:
            if isinstance(step, Drop):
                self.ledger.record(ItemsOutcome(step.model, list(step.items), step.status, step.reason))
        for message in (*out.acks, *(m for step in steps for m in step.acks)):
            message.ack()
        self._arm(next_poll_s)

    def _publish(self, send: Send) -> bool:
        batch, worker = send.batch, send.worker
        try:
            self.app.send_task(
                RUN_BATCH, args=[batch.to_dict()], queue=worker.queue, task_id=batch.id,
                argsrepr=batch_label(batch), retry=True, retry_policy=RETRY_POLICY,
            )
        except Exception:
            log.exception("could not hand batch %s to %s; keeping it", batch.id, worker.id)
            return False
        log.debug("batch %s size=%d -> %s", batch.id, len(batch.items), worker.id)
        adapters: dict[str, int] = {}
        for item in batch.items:
            if item.params.adapter:
                adapters[item.params.adapter] = adapters.get(item.params.adapter, 0) + 1
        if adapters:  # per-adapter traffic for /metrics; a miss is a lost count, never a lost batch
            try:
                self.stats.count_adapters(adapters)
            except redis.RedisError:
                log.warning("could not count batch %s's adapters", batch.id)
        return True

    def _arm(self, delay: float | None) -> None:
        if delay is None:
            return
        eta = time.monotonic() + delay
        if eta >= self._timer_eta:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._c.timer.call_after(max(delay, 0.0), self._on_timer)
        self._timer_eta = eta

    def _cancel_timers(self) -> None:
        for entry in (self._timer, self._tick):
            if entry is not None:
                entry.cancel()
        self._timer = self._tick = None
        self._timer_eta = float("inf")

    # -- the fleet view handed to the Batcher --------------------------------------------------------
    def _live_workers(self) -> list[WorkerInfo]:
        try:
            workers = self.workers.get()
        except redis.RedisError as exc:
            log.warning("cannot read the fleet from Redis (%s); keeping the last view", exc)
            workers = self.workers.keep()
        return self.recovery.routable(workers)


def batch_label(batch: Batch, shown: int = 4) -> str:
    """What Flower shows of a batch: its size and model, and the LoRA adapters its items name (a few, then how
    many more), so an operator sees which tenants' fine-tunes a worker runs."""
    label = f"batch of {len(batch.items)} for {batch.model}"
    adapters = sorted({i.params.adapter for i in batch.items if i.params.adapter})
    if adapters:
        more = f" +{len(adapters) - shown}" if len(adapters) > shown else ""
        label += f" (adapters: {', '.join(adapters[:shown])}{more})"
    return label


@click.command()
@click.option("--hostname", default=None, show_default="batcher-<pid>@<host>",
              help="Celery node name of this batcher: unique on its broker (two batchers of one name collide on "
                   "Celery's control queue), so the default holds the process id.")
def main(hostname: str | None) -> None:
    """Run the batcher: consume requests, form batches, route them to GPU workers."""
    hostname = hostname or f"batcher-{os.getpid()}@{socket.gethostname()}"
    settings = Settings.from_env()
    setup_logging(settings)
    tracing.setup("llmb-batcher")
    app = make_celery(settings)
    app.steps["consumer"].add(BatchingStep)
    signals.worker_ready.connect(lambda **_: settle(), weak=False)  # started: out of the collector's full passes
    app.worker_main(["worker", "--pool=solo", "--concurrency=1", f"--queues={settings.batcher_queue}",
                     f"--hostname={hostname}", f"--loglevel={settings.process.log_level}", "--without-gossip",
                     "--without-mingle", "--task-events"])


if __name__ == "__main__":
    main()
