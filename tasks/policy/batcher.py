"""The batcher: turns a stream of request messages into batches for the GPU workers, and returns its decisions.

Pure, with a clock and the fleet view injected: every call returns a
:class:`~tasks.policy.scheduler_output.SchedulerOutput` (the batches to publish to which worker's queue, the
items dropped and why, the messages then to acknowledge, when to look again), and the Celery bootstep in
:mod:`tasks.broker.consumer` carries it out. Guarantees:

- a request message is acknowledged only when every one of its items has been durably handed on in a batch
  (its send published, which means the broker confirmed it) or dropped because its deadline passed, so
  killing the batcher loses nothing: RabbitMQ redelivers whatever was unacknowledged;
- expired items are dropped before a batch is formed and never run, and so are items whose deadline would
  pass before the chosen worker could finish the batch (deadline-aware dropping: under overload the device
  spends its time on requests that can still be answered);
- when every worker for a model already holds its quota of batches (or none is alive), its items keep
  accumulating in the buffer, so batches grow toward full size while the devices are busy; the buffer is
  bounded by the consumer's prefetch.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tasks.config import Settings
from tasks.policy import tokens
from tasks.policy.fairness import FairBuffer, Waiting
from tasks.policy.flush import FlushPolicy
from tasks.policy.isolation import Plan, avoid, plan
from tasks.policy.prefix_routing import PrefixRouter
from tasks.policy.scheduler import Scheduler
from tasks.policy.scheduler_output import Delivery, Drop, Entry, SchedulerOutput, Send, Step, resolve
from tasks.policy.wait import ArrivalRate, WaitPolicy
from tasks.schema import Batch, BatchItem, Failure, InferenceRequest, SamplingParams, WorkerInfo

log = logging.getLogger(__name__)

# How old a worker's "started" announcement is believed to be, at most: the shared clock is good to a millisecond,
# but a clock that jumped must not make a running batch look finished (the next one would go out at once and wait,
# frozen small, at the worker).
EVENT_AGE_LIMIT_S = 0.1
MIN_DEFER_S = 0.001  # a model whose ready items all wait for their prefix's worker is asked again no sooner
EXPIRED = "deadline passed before it could run"


@dataclass(frozen=True)
class BatcherConfig:
    """How the batcher forms batches and picks their workers (the ``LLMB_*`` batcher settings it uses)."""

    policy: FlushPolicy = field(default_factory=FlushPolicy)
    wait: WaitPolicy | None = None  # how long a batch may wait to fill (None: the policy's fixed max_wait_s)
    max_outstanding: int = 2  # batches a worker may hold (beyond its slots)
    lead_s: float = 0.015  # a busy worker's next batch goes this long before its running one should end
    max_retries: int = 3  # deaths a batch's items survive before they are answered as exhausted
    quantum: int = 10  # fair queueing's quantum
    offline_wait_s: float = 0.5  # how long an offline batch may wait to fill
    prefix_routing: bool = True  # send items where their prompt's start is cached (tasks.policy.prefixes)
    prefix_wait_s: float = 1.0  # how long an item may wait for the busy worker caching its start
    adapter_routing: bool = True  # send items of a LoRA adapter where it is resident (tasks.policy.adapter_routing)
    max_adapters_per_batch: int = 4  # distinct LoRA adapters in one batch at most (0: no cap)

    @classmethod
    def from_settings(cls, settings: Settings) -> BatcherConfig:
        b = settings.batcher
        return cls(FlushPolicy(b.max_batch_size, b.max_wait_s, b.max_batch_bytes),
                   WaitPolicy(b.wait_mode, b.max_wait_s, b.min_wait_s, b.adaptive_max_wait_s),
                   max_outstanding=settings.worker.max_outstanding_batches, lead_s=b.dispatch_lead_s,
                   max_retries=b.max_retries, quantum=b.fair_quantum, offline_wait_s=b.offline_max_wait_s,
                   prefix_routing=b.prefix_routing, prefix_wait_s=b.prefix_wait_s,
                   adapter_routing=b.adapter_routing, max_adapters_per_batch=settings.models.max_adapters_per_batch)


class Batcher:
    def __init__(
        self,
        config: BatcherConfig,
        live_workers: Callable[[], list[WorkerInfo]],
        *,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
        stamp: Callable[[Batch, list[float], float], Batch] | None = None,
    ) -> None:
        self.config = config
        self.live_workers = live_workers
        self.clock = clock
        self.wallclock = wallclock
        # Marks a batch before it is sent, given when each item reached this batcher and the time now (wall
        # clock): tracing's spans (tasks.broker.consumer); None: sent as formed.
        self.stamp = stamp
        self.scheduler = Scheduler(config.max_outstanding, lead_s=config.lead_s)
        self.router = PrefixRouter(config.prefix_routing, config.prefix_wait_s, config.adapter_routing,
                                   wallclock)  # prefix- and adapter-aware routing
        self.wait = config.wait or WaitPolicy(mode="fixed", fixed_s=config.policy.max_wait_s)
        self.buffers: dict[str, FairBuffer[Entry]] = {}
        self.rates: dict[str, ArrivalRate] = {}  # items arriving per second, per model (for the adaptive wait)
        # Models whose ready batch found no worker able to take it, with when to try again (None: when a
        # worker announces something or the periodic poll runs). Their buffers keep filling meanwhile.
        self.held: dict[str, float | None] = {}
        # Models whose ready items all wait for the busy worker holding their prompt's start (prefix-aware
        # routing), with when to look again: new items of other tenants still go by the usual wait.
        self.deferred: dict[str, float] = {}
        # Batches that came back (split halves, reassigned ones): sent before any new batch of their model.
        # Each carries the recovery message it came from, acknowledged when the last of them is sent.
        self.retries: dict[str, deque[tuple[Batch, Delivery]]] = {}
        # Batches sent and not heard finished, with their worker: what to recover if that worker is lost.
        self.in_flight: dict[str, tuple[str, Batch, float]] = {}
        self.stats = {"requests": 0, "items": 0, "batches": 0, "dispatched_items": 0, "expired_items": 0,
                      "recovered_batches": 0}

    # -- input ---------------------------------------------------------------------------------------
    def add(self, request: InferenceRequest, ack: Callable[[], None]) -> SchedulerOutput:
        """Buffer a request's items and flush at once if that fills a batch; ``next_poll_s``: when this model's
        buffer needs a flush on its own (None: nothing to wait for)."""
        return self.add_message([request], ack)

    def add_message(self, requests: Sequence[InferenceRequest], ack: Callable[[], None]) -> SchedulerOutput:
        """:meth:`add` for the requests of one message, acknowledged once every item of all of them is resolved;
        ``next_poll_s``: the soonest flush any of their models needs (None: none)."""
        delivery = Delivery(ack=ack, remaining=sum(len(r.items) for r in requests))
        return SchedulerOutput.join([self._add(request, delivery) for request in requests])

    def _add(self, request: InferenceRequest, delivery: Delivery) -> SchedulerOutput:
        now = self.clock()
        offset = now - self.wallclock()  # epoch -> this process's monotonic clock
        model = request.model
        buffer = self.buffers.get(model)
        if buffer is None:
            buffer = self.buffers[model] = self._new_buffer()
        for index, item in enumerate(request.items):
            entry = Entry(
                BatchItem(id=item.id, request_id=request.id, input=item.input, deadline=request.deadline,
                          accepted_at=request.accepted_at, reply_to=request.reply_to, tenant=request.tenant,
                          params=choice_params(request.params, index), priority=request.priority,
                          trace=request.trace),
                delivery,
            )
            buffer.add(entry, now=now, deadline=request.deadline + offset, tenant=request.tenant,
                       weight=request.weight, priority=request.priority, cost=tokens.cost(item.input, request.params))
        self.rates.setdefault(model, ArrivalRate()).observe(len(request.items), now)
        self.stats["requests"] += 1
        self.stats["items"] += len(request.items)
        if model in self.held:  # already waiting for a worker; a full batch changes nothing
            return SchedulerOutput(next_poll_s=self._held_for(model, now))
        due = self.deferred.get(model)
        if due is not None and now < due:  # the new items wait as usual, the deferred ones as long as they may
            due = self.deferred[model] = min(due, now + self._wait_s(model, buffer, now))
            return SchedulerOutput(next_poll_s=due - now)
        if not buffer.is_ready(now, self._wait_s(model, buffer, now)):
            return SchedulerOutput(next_poll_s=buffer.seconds_until_ready(now, self._wait_s(model, buffer, now)))
        steps = tuple(self.flush(model))
        left, now = self.buffers.get(model), self.clock()
        if left is None or model in self.held:
            return SchedulerOutput(steps, None if left is None else self._held_for(model, now))
        if model in self.deferred:
            return SchedulerOutput(steps, max(0.0, self.deferred[model] - now))
        return SchedulerOutput(steps, left.seconds_until_ready(now, self._wait_s(model, left, now)))

    def _held_for(self, model: str, now: float) -> float | None:
        """Seconds until a held model is asked about again (None: on news from the fleet)."""
        at = self.held[model]
        return None if at is None else max(0.0, at - now)

    def discard_all(self) -> int:
        """Forget every buffered item and retry without acknowledging it (the broker will redeliver them)."""
        count = sum(len(b.clear()) for b in self.buffers.values()) + sum(len(r) for r in self.retries.values())
        self.buffers.clear()
        self.retries.clear()
        self.held.clear()
        self.deferred.clear()
        return count

    # -- output --------------------------------------------------------------------------------------
    def poll(self) -> SchedulerOutput:
        """Drop expired items and flush every ready batch; ``next_poll_s``: when the next poll is needed.

        Models held for want of a worker, or deferred for their prefixes' workers, are flushed only once their
        retry time is due.
        """
        steps = [s for model in list(self.buffers.keys() | self.retries.keys()) if self._may_flush(model)
                 for s in self.flush(model)]
        return SchedulerOutput(tuple(steps), self._next_poll_s(self.clock()))

    def _may_flush(self, model: str) -> bool:
        """Neither held nor deferred, or its time to be asked again has come."""
        if model not in self.held and model not in self.deferred:
            return True
        retry_at = self.held[model] if model in self.held else self.deferred.get(model)
        return retry_at is not None and retry_at <= self.clock()

    def _next_poll_s(self, now: float) -> float | None:
        """Seconds until some model needs a flush: its wait is over or its retry time has come (None: none)."""
        waits = [w for m, b in self.buffers.items() if m not in self.held and m not in self.deferred
                 and (w := b.seconds_until_ready(now, self._wait_s(m, b, now))) is not None]
        waits += [0.0 for m in self.retries if m not in self.held]
        waits += [max(0.0, at - now) for at in [*self.held.values(), *self.deferred.values()] if at is not None]
        return min(waits, default=None)

    def flush(self, model: str) -> list[Step]:
        """Every batch of ``model`` due now, in order: batches that came back first, then new ones from its
        buffer, each to the best worker able to take it, less the items that could not finish there in time.
        Ends when none is due, when no worker can take one (the model is held), or when every ready item waits
        for the busy worker caching its prompt's start (the model is deferred)."""
        buffer = self.buffers.get(model) or self._new_buffer()
        retries = self.retries.get(model) or deque()
        now = self.clock()
        steps = self._expire(model, buffer, now)
        self.held.pop(model, None)
        self.deferred.pop(model, None)
        workers: list[WorkerInfo] | None = None
        while (retries or buffer.is_ready(now, self._wait_s(model, buffer, now))) and not self._waiting(model):
            workers = self._fleet() if workers is None else workers
            steps += self._next_steps(model, buffer, retries, workers, now)
        if not retries:
            self.retries.pop(model, None)
        if not buffer:
            self.buffers.pop(model, None)
        if not buffer and not retries:
            self.held.pop(model, None)
            self.deferred.pop(model, None)
        return steps

    def _waiting(self, model: str) -> bool:
        return model in self.held or model in self.deferred

    def _next_steps(self, model: str, buffer: FairBuffer[Entry], retries: deque[tuple[Batch, Delivery]],
                    workers: list[WorkerInfo], now: float) -> list[Step]:
        """One step of :meth:`flush`: the next batch and where it goes, the items dropped before it, or the
        model held or deferred (no step)."""
        choices, soonest = self.scheduler.choices(workers, model, now, avoid=avoid(retries[0][0]) if retries else ())
        worker = choices[0].worker if choices else None
        if worker is None:  # every worker is busy enough (or none is alive): keep accumulating
            self.held[model] = None if soonest is None else now + soonest
            log.debug("holding %d %s items: %d live workers, retry in %s s", len(buffer), model, len(workers),
                      soonest)
            return []
        if retries:
            batch, delivery = retries.popleft()
            self._sent(batch, worker)
            return [Send(batch, worker, resolve([delivery]), retry_of=delivery)]
        dropped = self._expire(model, buffer, now + self.scheduler.batch_s(worker))
        if dropped:
            return dropped  # items that could not finish in time are gone: is a batch still due?
        pending = buffer.take(token_limit=choices[0].kv_room, later=self.router.later(model, workers, choices, now))
        if not pending:  # every ready item waits for the worker holding its prompt's start
            self.deferred[model] = now + max(MIN_DEFER_S, self.router.soonest_due(buffer, now))
            return []
        routes = self.router.routes(pending, choices, lambda w: self.scheduler.load(w, now))
        return [self._send(model, items, target) for target, items in routes]

    def unsent(self, steps: Sequence[Step]) -> SchedulerOutput:
        """The consumer could not publish ``steps[0]`` (the broker is away): it and the batches after it go back
        where they came from, unacknowledged, and their models are held until the next retry; the drops after
        it stand, and are acknowledged only where they do not wait on a batch put back."""
        sends = [s for s in steps if isinstance(s, Send)]
        for send in reversed(sends):
            model = send.batch.model
            self.scheduler.finished(send.worker.id, send.batch.id)  # never reached it
            self.in_flight.pop(send.batch.id, None)
            if send.retry_of is not None:
                send.retry_of.remaining += 1
                self.retries.setdefault(model, deque()).appendleft((send.batch, send.retry_of))
            else:
                for p in send.taken:
                    p.item.delivery.remaining += 1
                self.buffers.setdefault(model, self._new_buffer()).put_back(list(send.taken))
                self.stats["batches"] -= 1
                self.stats["dispatched_items"] -= len(send.taken)
            self.held[model] = None
            self.deferred.pop(model, None)
        drops = [replace(d, acks=tuple(a for a in d.acks if a.remaining == 0)) for d in steps if isinstance(d, Drop)]
        return SchedulerOutput(tuple(drops), self._next_poll_s(self.clock()))

    def _fleet(self) -> list[WorkerInfo]:
        """The live workers, with what their heartbeats say brought into the scheduler and the prefix index."""
        workers = self.live_workers()
        self.scheduler.reconcile(workers, self.clock() - self.wallclock())
        self.router.report(workers)
        return workers

    def _send(self, model: str, items: list[Waiting[Entry]], worker: WorkerInfo) -> Send:
        """These buffered items as one batch to ``worker``; their messages are resolved by it."""
        batch = self._batch(model, items)
        if self.stamp is not None:
            wall = self.wallclock()
            offset = self.clock() - wall
            batch = self.stamp(batch, [p.arrived - offset for p in items], wall)
        self._sent(batch, worker)
        self.stats["batches"] += 1
        self.stats["dispatched_items"] += len(items)
        self.router.sent(worker.id, batch, self.wallclock())
        return Send(batch, worker, resolve(p.item.delivery for p in items), taken=tuple(items))

    def _sent(self, batch: Batch, worker: WorkerInfo) -> None:
        """Count ``batch`` as ``worker``'s from now on (:meth:`unsent` takes it back if it is not published)."""
        now = self.clock()
        kv = sum(tokens.estimated_tokens(i.input, i.params) or 0 for i in batch.items)
        self.scheduler.sent(worker.id, batch.id, now, kv)
        self.in_flight[batch.id] = (worker.id, batch, now)

    def started(self, worker_id: str, batch_id: str, at: float | None = None,
                idle_s: float | None = None) -> SchedulerOutput:
        """A worker started a batch: its backlog estimate is now exact; held batches may go (:meth:`retry_held`).

        ``at``: when it started, on the shared wall clock. The announcement takes a few ms to get here, tens on
        a saturated host; dated by its arrival, the next batch would be handed over that much late, with the
        device idle meanwhile. How far back it is believed is bounded (:data:`EVENT_AGE_LIMIT_S`). ``idle_s``:
        how long the device sat free before the batch reached it (the scheduler learns its lead from it)."""
        now = self.clock()
        age = 0.0 if at is None else min(EVENT_AGE_LIMIT_S, max(0.0, self.wallclock() - at))
        self.scheduler.started(worker_id, batch_id, now - age, idle_s)
        return self.retry_held()

    def finished(self, worker_id: str, batch_id: str, run_s: float | None = None,
                 tokens_by_tenant: Mapping[str, int] | None = None) -> SchedulerOutput:
        """A worker finished a batch: its slot is free, so held batches may go now (:meth:`retry_held`).

        ``tokens_by_tenant``: what the batch's items really took (prompt and completion tokens, from the
        worker); each tenant's share is corrected by the difference from the estimate it was charged."""
        self.scheduler.finished(worker_id, batch_id, run_s)
        held = self.in_flight.pop(batch_id, None)
        if held is not None and tokens_by_tenant:
            batch = held[1]
            buffer = self.buffers.get(batch.model)
            if buffer is not None:
                estimated: dict[str, float] = {}
                for item in batch.items:
                    estimated[item.tenant] = estimated.get(item.tenant, 0.0) + tokens.cost(item.input, item.params)
                for tenant, used in tokens_by_tenant.items():
                    if tenant in estimated:
                        buffer.charge(tenant, used - estimated[tenant])
        return self.retry_held()

    # -- recovery ------------------------------------------------------------------------------------
    def recover(self, batch: Batch, failure: Failure, died_on: str = "") -> Plan:
        """Decide what to do with a batch that did not finish (``died_on``: the worker it died on, if it died).
        The caller answers the plan's failed items, then hands its batches to :meth:`requeue`."""
        self.in_flight.pop(batch.id, None)
        decided = plan(batch, failure, now=self.wallclock(), max_retries=self.config.max_retries, died_on=died_on)
        self.stats["recovered_batches"] += 1
        log.info("batch %s (%d items) came back (%s): %d batch(es) to send again, %d poison, %d exhausted",
                 batch.id, len(batch.items), failure, len(decided.batches), len(decided.poison),
                 len(decided.exhausted), extra={"batch_id": batch.id})
        return decided

    def requeue(self, batches: list[Batch], ack: Callable[[], None]) -> SchedulerOutput:
        """Send these batches ahead of new ones; ``ack``: the recovery message, acknowledged once all of them are
        handed to workers (at once if there are none)."""
        delivery = Delivery(ack=ack, remaining=len(batches))
        if not batches:
            return replace(self.poll(), acks=(delivery,))
        for b in batches:
            self.retries.setdefault(b.model, deque()).append((b, delivery))
            self.held.pop(b.model, None)
        return self.poll()

    def held_by(self, worker_id: str) -> list[Batch]:
        """The batches this batcher sent ``worker_id`` and has not heard finish."""
        return [b for wid, b, _ in self.in_flight.values() if wid == worker_id]

    def forget_in_flight(self, batch_id: str) -> None:
        """A lost worker's batch is in the recovery queue now: it is no longer this worker's."""
        self.in_flight.pop(batch_id, None)

    def worker_lost(self, worker_id: str) -> None:
        """Forget what the scheduler knew of a lost worker (its batches were taken back first)."""
        self.scheduler.forget_worker(worker_id)
        self.router.forget(worker_id)

    def forget_stale_in_flight(self, older_than_s: float) -> None:
        """Drop in-flight records whose finish was never heard (a lost announcement), to bound memory."""
        horizon = self.clock() - older_than_s
        for batch_id in [b for b, (_, _, at) in self.in_flight.items() if at < horizon]:
            del self.in_flight[batch_id]

    def retry_held(self) -> SchedulerOutput:
        """Ask the scheduler again for every held model (on news from the fleet, and periodically)."""
        for model in self.held:
            self.held[model] = self.clock()  # due now: poll() re-asks the scheduler
        for model in self.deferred:
            self.deferred[model] = self.clock()  # a prefix's worker may take a batch now
        return self.poll()

    def _new_buffer(self) -> FairBuffer[Entry]:
        c = self.config
        return FairBuffer(c.policy, quantum=c.quantum, offline_wait_s=c.offline_wait_s, size_of=_size,
                          adapter_of=_adapter, max_adapters=c.max_adapters_per_batch)

    def _wait_s(self, model: str, buffer: FairBuffer[Entry], now: float) -> float:
        """How long this model's oldest interactive item may wait (see :mod:`tasks.policy.wait`)."""
        if self.wait.mode == "fixed" or not buffer:
            return self.wait.fixed_s
        workers = self.live_workers()
        times = [w.batch_ms_estimate / 1000 for w in workers if w.model == model and w.batch_ms_estimate > 0]
        oldest = buffer.oldest_interactive()  # the wait applies to interactive items (offline ones have their own)
        rate = self.rates[model].rate(now) if model in self.rates else 0.0
        return self.wait.wait_s(
            waiting=len(buffer), waited_s=0.0 if oldest is None else now - oldest,
            max_batch=self.config.policy.max_batch_size, rate_per_s=rate,
            batch_s=sum(times) / len(times) if times else None,
            device_free=self.scheduler.choose(workers, model, now).worker is not None,
        )

    def _expire(self, model: str, buffer: FairBuffer[Entry], horizon: float) -> list[Step]:
        """Drop items whose deadline falls before ``horizon``: their callers are gone by then anyway."""
        dropped = buffer.drop_expired(horizon)
        if not dropped:
            return []
        self.stats["expired_items"] += len(dropped)
        return [Drop(model, tuple(e.item for e in dropped), "expired", EXPIRED, resolve(e.delivery for e in dropped))]

    def _batch(self, model: str, pending: list[Waiting[Entry]]) -> Batch:
        return Batch(
            id=uuid.uuid4().hex, model=model, created_at=self.wallclock(),
            items=tuple(p.item.item for p in pending),
        )


ITEM_OVERHEAD_BYTES = 400  # ids, deadline, reply channel and parameters of one item in a batch message


def _size(entry: Entry) -> int:
    """An item's share of its batch message, in bytes, without encoding it: JSON writes each non-ASCII
    character as a 6-byte escape (12 for characters beyond the BMP, so this can undercount those by half;
    the batch limit leaves RabbitMQ's own 128 MiB limit far away)."""
    text = entry.item.input
    return ITEM_OVERHEAD_BYTES + (len(text) if text.isascii() else 6 * len(text))


def _adapter(entry: Entry) -> str | None:
    """An item's LoRA adapter (None: the base model), for the batch's adapter cap."""
    return entry.item.params.adapter or None


SEED_SPAN = 2**64  # torch.manual_seed takes -2**63 .. 2**64 - 1


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of the ``index``-th item of a call: a seeded call asking for ``n`` choices of each prompt
    samples choice ``j`` (``index % n``) with ``seed + j``, so its choices differ yet come out the same each
    time, the first as with ``n=1``; any other call's items share its parameters as they are."""
    n, seed = params.n, params.seed
    if n <= 1 or seed is None or index % n == 0:
        return params
    seeded = seed + index % n
    return replace(params, seed=seeded if seeded < SEED_SPAN else seeded - SEED_SPAN)
