"""The batcher: turns a stream of request messages into batches and hands each to a GPU worker.

Plain Python with its I/O injected (a ``dispatch`` function and a ``live_workers`` function), so the
Celery bootstep in :mod:`tasks.broker.consumer` is only glue. Guarantees:

- a request message is acknowledged only when every one of its items has been durably handed on in a batch
  (``dispatch`` returned, which means the broker confirmed it) or dropped because its deadline passed, so
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
from dataclasses import dataclass, field
from typing import Any

from tasks.policy import tokens
from tasks.policy.fairness import FairBuffer, Waiting
from tasks.policy.flush import FlushPolicy
from tasks.policy.isolation import Plan, avoid, plan
from tasks.policy.prefixes import Option, PrefixIndex, assign, prefix_keys
from tasks.policy.scheduler import Choice, Scheduler
from tasks.policy.wait import ArrivalRate, WaitPolicy
from tasks.schema import Batch, BatchItem, Failure, InferenceRequest, WorkerInfo

log = logging.getLogger(__name__)

# How old a worker's "started" announcement is believed to be, at most: the shared clock is good to a millisecond,
# but a clock that jumped must not make a running batch look finished (the next one would go out at once and wait,
# frozen small, at the worker).
EVENT_AGE_LIMIT_S = 0.1

Dispatch = Callable[[Batch, WorkerInfo], None]
MIN_DEFER_S = 0.001  # a model whose ready items all wait for their prefix's worker is asked again no sooner


@dataclass
class _Delivery:
    """One request message: acknowledged when its last item is resolved."""

    ack: Callable[[], None]
    remaining: int

    def resolve(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.ack()


@dataclass(frozen=True)
class _Entry:
    item: BatchItem
    delivery: _Delivery = field(compare=False)


class Batcher:
    def __init__(
        self,
        policy: FlushPolicy,
        dispatch: Dispatch,
        live_workers: Callable[[], list[WorkerInfo]],
        *,
        max_outstanding: int = 2,
        lead_s: float = 0.015,
        max_retries: int = 3,
        wait: WaitPolicy | None = None,
        quantum: int = 10,
        offline_wait_s: float = 0.5,
        on_dropped: Callable[[str, list[BatchItem]], None] = lambda model, items: None,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
        prefix_routing: bool = True,
        prefix_wait_s: float = 1.0,
        stamp: Callable[[Batch, list[float], float], Batch] | None = None,
    ) -> None:
        self.policy = policy
        self.max_retries = max_retries
        self.on_dropped = on_dropped
        self.dispatch = dispatch
        self.live_workers = live_workers
        self.clock = clock
        self.wallclock = wallclock
        self.scheduler = Scheduler(max_outstanding, lead_s=lead_s)
        self.prefixes = PrefixIndex()  # which prompt starts each worker's cache holds (prefix-aware routing)
        self.prefix_routing = prefix_routing
        self.prefix_wait_s = prefix_wait_s
        # Marks a batch before it is sent, given when each item reached this batcher and the time now (wall
        # clock): tracing's spans (tasks.broker.consumer); None: sent as formed.
        self.stamp = stamp
        self.wait = wait or WaitPolicy(mode="fixed", fixed_s=policy.max_wait_s)
        self.quantum = quantum
        self.offline_wait_s = offline_wait_s
        self.buffers: dict[str, FairBuffer[_Entry]] = {}
        self.rates: dict[str, ArrivalRate] = {}  # items arriving per second, per model (for the adaptive wait)
        # Models whose ready batch found no worker able to take it, with when to try again (None: when a
        # worker announces something or the periodic poll runs). Their buffers keep filling meanwhile.
        self.held: dict[str, float | None] = {}
        # Models whose ready items all wait for the busy worker holding their prompt's start (prefix-aware
        # routing), with when to look again: new items of other tenants still go by the usual wait.
        self.deferred: dict[str, float] = {}
        # Batches that came back (split halves, reassigned ones): sent before any new batch of their model.
        # Each carries the ack of the recovery message it came from, given when the last of them is sent.
        self.retries: dict[str, deque[tuple[Batch, _Delivery]]] = {}
        # Batches sent and not heard finished, with their worker: what to recover if that worker is lost.
        self.in_flight: dict[str, tuple[str, Batch, float]] = {}
        self.stats = {"requests": 0, "items": 0, "batches": 0, "dispatched_items": 0, "expired_items": 0,
                      "recovered_batches": 0}

    # -- input ---------------------------------------------------------------------------------------
    def add(self, request: InferenceRequest, ack: Callable[[], None]) -> float | None:
        """Buffer a request's items and flush at once if that fills a batch.

        Returns seconds until this model's buffer needs a flush on its own (None: nothing to wait for).
        """
        return self.add_message([request], ack)

    def add_message(self, requests: Sequence[InferenceRequest], ack: Callable[[], None]) -> float | None:
        """:meth:`add` for the requests of one message, acknowledged once every item of all of them is resolved;
        returns the soonest flush any of their models needs (None: none)."""
        delivery = _Delivery(ack=ack, remaining=sum(len(r.items) for r in requests))
        delays = [self._add(request, delivery) for request in requests]
        return min((d for d in delays if d is not None), default=None)

    def _add(self, request: InferenceRequest, delivery: _Delivery) -> float | None:
        now = self.clock()
        offset = now - self.wallclock()  # epoch -> this process's monotonic clock
        buffer = self.buffers.get(request.model)
        if buffer is None:
            buffer = self.buffers[request.model] = self._new_buffer()
        for index, item in enumerate(request.items):
            entry = _Entry(
                BatchItem(id=item.id, request_id=request.id, input=item.input, deadline=request.deadline,
                          accepted_at=request.accepted_at, reply_to=request.reply_to, tenant=request.tenant,
                          params=choice_params(request.params, index), priority=request.priority,
                          trace=request.trace),
                delivery,
            )
            buffer.add(entry, now=now, deadline=request.deadline + offset, tenant=request.tenant,
                       weight=request.weight, priority=request.priority, cost=tokens.cost(item.input, request.params))
        self.rates.setdefault(request.model, ArrivalRate()).observe(len(request.items), now)
        self.stats["requests"] += 1
        self.stats["items"] += len(request.items)
        if request.model in self.held:
            return self._held_for(request.model, now)  # already waiting for a worker; a full batch changes nothing
        due = self.deferred.get(request.model)
        if due is not None and now < due:  # the new items wait as usual, the deferred ones as long as they may
            due = self.deferred[request.model] = min(due, now + self._wait_s(request.model, buffer, now))
            return due - now
        if buffer.is_ready(now, self._wait_s(request.model, buffer, now)):
            self.flush(request.model)
            buffer = self.buffers.get(request.model)
            now = self.clock()
            if buffer is None or request.model in self.held:
                return None if buffer is None else self._held_for(request.model, now)
            if request.model in self.deferred:
                return max(0.0, self.deferred[request.model] - now)
        return buffer.seconds_until_ready(now, self._wait_s(request.model, buffer, now))

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
    def poll(self) -> float | None:
        """Drop expired items and flush every ready batch; returns seconds until the next poll is needed.

        Models held for want of a worker, or deferred for their prefixes' workers, are flushed only once their
        retry time is due.
        """
        for model in list(self.buffers.keys() | self.retries.keys()):
            retry_at = self.held[model] if model in self.held else self.deferred.get(model)
            if (model not in self.held and model not in self.deferred) or (
                    retry_at is not None and retry_at <= self.clock()):
                self.flush(model)
        now = self.clock()
        waits = [w for m, b in self.buffers.items() if m not in self.held and m not in self.deferred
                 and (w := b.seconds_until_ready(now, self._wait_s(m, b, now))) is not None]
        waits += [0.0 for m in self.retries if m not in self.held]
        waits += [max(0.0, at - now) for at in [*self.held.values(), *self.deferred.values()] if at is not None]
        return min(waits, default=None)

    def flush(self, model: str) -> int:
        """Send as many ready batches of ``model`` as there are; returns how many were sent."""
        buffer = self.buffers.get(model) or self._new_buffer()
        retries = self.retries.get(model) or deque()
        now = self.clock()
        self._drop(model, buffer, now)
        sent = 0
        self.held.pop(model, None)
        self.deferred.pop(model, None)
        workers: list[WorkerInfo] | None = None
        while retries or buffer.is_ready(now, self._wait_s(model, buffer, now)):
            if workers is None:
                workers = self._fleet()
            choices, soonest = self.scheduler.choices(workers, model, now,
                                                      avoid=avoid(retries[0][0]) if retries else ())
            choice = choices[0] if choices else Choice(None, soonest)
            worker = choice.worker
            if worker is None:  # every worker is busy enough (or none is alive): keep accumulating
                self.held[model] = None if choice.retry_in_s is None else now + choice.retry_in_s
                log.debug("holding %d %s items: %d live workers, retry in %s s", len(buffer), model,
                          len(workers), choice.retry_in_s)
                break
            if retries:
                batch, delivery = retries.popleft()
                if not self._send(batch, worker):
                    retries.appendleft((batch, delivery))
                    self.held[model] = None
                    break
                delivery.resolve()
                sent += 1
                continue
            if self._drop(model, buffer, now + self.scheduler.batch_s(worker)):
                continue  # items that could not finish in time are gone: is a batch still due?
            pending = buffer.take(token_limit=choice.kv_room, later=self._later(model, workers, choices, now))
            if not pending:  # every ready item waits for the worker holding its prompt's start
                self.deferred[model] = now + max(MIN_DEFER_S, self._soonest_due(buffer, now))
                break
            routes = self._routes(pending, choices, now)
            failed = [items for target, items in routes if not self._send_items(model, items, target)]
            sent += len(routes) - len(failed)
            if failed:
                buffer.put_back([p for items in failed for p in items])
                self.held[model] = None
                break
            now = self.clock()
        if not retries:
            self.retries.pop(model, None)
        if not buffer:
            self.buffers.pop(model, None)
        if not buffer and not retries:
            self.held.pop(model, None)
            self.deferred.pop(model, None)
        return sent

    def _fleet(self) -> list[WorkerInfo]:
        """The live workers, with what their heartbeats say brought into the scheduler and the prefix index."""
        workers = self.live_workers()
        self.scheduler.reconcile(workers, self.clock() - self.wallclock())
        for w in workers if self.prefix_routing else ():
            if w.prefix_caching:  # it keeps a prefix cache: route by it
                self.prefixes.report(w.id, w.prefixes, w.heartbeat_at)
        return workers

    def _later(self, model: str, workers: list[WorkerInfo],
               choices: list[Choice], now: float) -> Callable[[Waiting[_Entry]], bool] | None:
        """Which items to leave for a later batch: those of which a worker that cannot take a batch now holds a
        longer prompt start than any worker that can, while they have waited less than ``prefix_wait_s`` and
        their deadline is not near (a hit saves its prefill, and a miss would also copy the start to a second
        cache). None: routing is off, or fewer than two workers report a prefix cache."""
        homes = [w.id for w in workers if w.model == model and self.prefixes.knows(w.id)]
        if not self.prefix_routing or len(homes) < 2 or self.prefix_wait_s <= 0:
            return None
        able = {c.worker.id for c in choices if c.worker is not None}
        able_homes = [h for h in homes if h in able]
        wait = self.prefix_wait_s

        def later(w: Waiting[_Entry]) -> bool:
            if now - w.arrived >= wait or w.deadline - now < 2 * wait:
                return False
            keys = prefix_keys(w.item.item.input)
            home, match = self.prefixes.home(keys, homes)
            return home is not None and home not in able and match > self.prefixes.home(keys, able_homes)[1]

        return later

    def _soonest_due(self, buffer: FairBuffer[_Entry], now: float) -> float:
        """Seconds until the first item left for its worker stops waiting for it (it has waited
        ``prefix_wait_s``, or its deadline is near: :meth:`_later`)."""
        wait = self.prefix_wait_s
        return max(0.0, min((min(w.arrived + wait, w.deadline - 2 * wait) - now for w in buffer), default=0.0))

    def _routes(self, pending: list[Waiting[_Entry]], choices: list[Choice],
                now: float) -> list[tuple[WorkerInfo, list[Waiting[_Entry]]]]:
        """Where the items of a batch go: to the scheduler's choice, but for items whose prompt start another
        worker able to take a batch now holds in its prefix cache (:func:`tasks.policy.prefixes.assign`); a
        group over that worker's KV room stays with the scheduler's choice."""
        first = choices[0].worker
        assert first is not None
        if len(choices) < 2 or not any(c.worker is not None and self.prefixes.knows(c.worker.id) for c in choices):
            return [(first, pending)]
        workers = [c.worker for c in choices if c.worker is not None]
        options = [Option(w.id, self.scheduler.load(w, now)) for w in workers]
        where = assign([prefix_keys(p.item.item.input) for p in pending], options, self.prefixes)
        groups: dict[int, list[Waiting[_Entry]]] = {}
        for p, i in zip(pending, where):
            groups.setdefault(i, []).append(p)
        routes, stay = [], groups.pop(0, [])
        for i, items in groups.items():
            room = choices[i].kv_room
            if room is not None and sum(p.cost for p in items) > room:
                stay += items
            else:
                routes.append((workers[i], items))
        return [(first, stay), *routes] if stay else routes

    def _send_items(self, model: str, items: list[Waiting[_Entry]], worker: WorkerInfo) -> bool:
        """Send these buffered items as one batch; resolve them once it is handed on."""
        batch = self._batch(model, items)
        if self.stamp is not None:
            wall = self.wallclock()
            offset = self.clock() - wall
            batch = self.stamp(batch, [p.arrived - offset for p in items], wall)
        if not self._send(batch, worker):
            return False
        for p in items:
            p.item.delivery.resolve()
        self.stats["batches"] += 1
        self.stats["dispatched_items"] += len(items)
        if self.prefixes.knows(worker.id):
            self.prefixes.sent(worker.id, [prefix_keys(i.input) for i in batch.items], self.wallclock())
        return True

    def _send(self, batch: Batch, worker: WorkerInfo) -> bool:
        try:
            self.dispatch(batch, worker)
        except Exception:
            log.exception("could not hand batch %s to %s; keeping it", batch.id, worker.id)
            return False
        now = self.clock()
        kv = sum(tokens.estimated_tokens(i.input, i.params) or 0 for i in batch.items)
        self.scheduler.sent(worker.id, batch.id, now, kv)
        self.in_flight[batch.id] = (worker.id, batch, now)
        return True

    def started(self, worker_id: str, batch_id: str, at: float | None = None,
                idle_s: float | None = None) -> float | None:
        """A worker started a batch: its backlog estimate is now exact. Returns poll()'s delay.

        ``at``: when it started, on the shared wall clock. The announcement takes a few ms to get here, tens on
        a saturated host; dated by its arrival, the next batch would be handed over that much late, with the
        device idle meanwhile. How far back it is believed is bounded (:data:`EVENT_AGE_LIMIT_S`). ``idle_s``:
        how long the device sat free before the batch reached it (the scheduler learns its lead from it)."""
        now = self.clock()
        age = 0.0 if at is None else min(EVENT_AGE_LIMIT_S, max(0.0, self.wallclock() - at))
        self.scheduler.started(worker_id, batch_id, now - age, idle_s)
        return self.retry_held()

    def finished(self, worker_id: str, batch_id: str, run_s: float | None = None,
                 tokens_by_tenant: Mapping[str, int] | None = None) -> float | None:
        """A worker finished a batch: its slot is free, so held batches may go now. Returns poll()'s delay.

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
        decided = plan(batch, failure, now=self.wallclock(), max_retries=self.max_retries, died_on=died_on)
        self.stats["recovered_batches"] += 1
        log.info("batch %s (%d items) came back (%s): %d batch(es) to send again, %d poison, %d exhausted",
                 batch.id, len(batch.items), failure, len(decided.batches), len(decided.poison),
                 len(decided.exhausted), extra={"batch_id": batch.id})
        return decided

    def requeue(self, batches: list[Batch], ack: Callable[[], None]) -> float | None:
        """Send these batches ahead of new ones; ``ack`` runs once all of them are handed to workers."""
        if not batches:
            ack()
            return self.poll()
        delivery = _Delivery(ack=ack, remaining=len(batches))
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
        self.prefixes.forget(worker_id)

    def forget_stale_in_flight(self, older_than_s: float) -> None:
        """Drop in-flight records whose finish was never heard (a lost announcement), to bound memory."""
        horizon = self.clock() - older_than_s
        for batch_id in [b for b, (_, _, at) in self.in_flight.items() if at < horizon]:
            del self.in_flight[batch_id]

    def retry_held(self) -> float | None:
        """Ask the scheduler again for every held model (on news from the fleet, and periodically)."""
        for model in self.held:
            self.held[model] = self.clock()  # due now: poll() re-asks the scheduler
        for model in self.deferred:
            self.deferred[model] = self.clock()  # a prefix's worker may take a batch now
        return self.poll()

    def _new_buffer(self) -> FairBuffer[_Entry]:
        return FairBuffer(self.policy, quantum=self.quantum, offline_wait_s=self.offline_wait_s, size_of=_size)

    def _wait_s(self, model: str, buffer: FairBuffer[_Entry], now: float) -> float:
        """How long this model's oldest interactive item may wait (see :mod:`tasks.policy.wait`)."""
        if self.wait.mode == "fixed" or not buffer:
            return self.wait.fixed_s
        workers = self.live_workers()
        times = [w.batch_ms_estimate / 1000 for w in workers if w.model == model and w.batch_ms_estimate > 0]
        oldest = buffer.oldest_interactive()  # the wait applies to interactive items (offline ones have their own)
        rate = self.rates[model].rate(now) if model in self.rates else 0.0
        return self.wait.wait_s(
            waiting=len(buffer), waited_s=0.0 if oldest is None else now - oldest,
            max_batch=self.policy.max_batch_size, rate_per_s=rate,
            batch_s=sum(times) / len(times) if times else None,
            device_free=self.scheduler.choose(workers, model, now).worker is not None,
        )

    def _drop(self, model: str, buffer: FairBuffer[_Entry], horizon: float) -> int:
        """Drop items whose deadline falls before ``horizon``: their callers are gone by then anyway."""
        dropped = buffer.drop_expired(horizon)
        for entry in dropped:
            entry.delivery.resolve()
        if dropped:
            self.stats["expired_items"] += len(dropped)
            self.on_dropped(model, [e.item for e in dropped])
        return len(dropped)

    def _batch(self, model: str, pending: list[Waiting[_Entry]]) -> Batch:
        return Batch(
            id=uuid.uuid4().hex, model=model, created_at=self.wallclock(),
            items=tuple(p.item.item for p in pending),
        )


ITEM_OVERHEAD_BYTES = 400  # ids, deadline, reply channel and parameters of one item in a batch message


def _size(entry: _Entry) -> int:
    """An item's share of its batch message, in bytes, without encoding it: JSON writes each non-ASCII
    character as a 6-byte escape (12 for characters beyond the BMP, so this can undercount those by half;
    the batch limit leaves RabbitMQ's own 128 MiB limit far away)."""
    text = entry.item.input
    return ITEM_OVERHEAD_BYTES + (len(text) if text.isascii() else 6 * len(text))


SEED_SPAN = 2**64  # torch.manual_seed takes -2**63 .. 2**64 - 1


def choice_params(params: dict[str, Any], index: int) -> dict[str, Any]:
    """The parameters of the ``index``-th item of a call: a seeded call asking for ``n`` choices of each prompt
    samples choice ``j`` (``index % n``) with ``seed + j``, so its choices differ yet come out the same each
    time, the first as with ``n=1``; any other call's items share its parameters as they are."""
    n, seed = params.get("n", 1), params.get("seed")
    if n <= 1 or seed is None or index % n == 0:
        return params
    seeded = seed + index % n
    return {**params, "seed": seeded if seeded < SEED_SPAN else seeded - SEED_SPAN}
