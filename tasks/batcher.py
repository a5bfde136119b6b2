"""The batcher: turns a stream of request messages into batches and hands each to a GPU worker.

Plain Python with its I/O injected (a ``dispatch`` function and a ``live_workers`` function), so the
Celery bootstep in :mod:`tasks.consumer` is only glue. Guarantees:

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
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.flush import BatchBuffer, FlushPolicy, Pending
from tasks.fleet import WorkerInfo
from tasks.scheduler import Scheduler
from tasks.schema import Batch, BatchItem, InferenceRequest

log = logging.getLogger(__name__)

Dispatch = Callable[[Batch, WorkerInfo], None]


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
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.dispatch = dispatch
        self.live_workers = live_workers
        self.clock = clock
        self.wallclock = wallclock
        self.scheduler = Scheduler(max_outstanding, lead_s=lead_s)
        self.buffers: dict[str, BatchBuffer[_Entry]] = {}
        # Models whose ready batch found no worker able to take it, with when to try again (None: when a
        # worker announces something or the periodic poll runs). Their buffers keep filling meanwhile.
        self.held: dict[str, float | None] = {}
        self.stats = {"requests": 0, "items": 0, "batches": 0, "dispatched_items": 0, "expired_items": 0}

    # -- input ---------------------------------------------------------------------------------------
    def add(self, request: InferenceRequest, ack: Callable[[], None]) -> float | None:
        """Buffer a request's items and flush at once if that fills a batch.

        Returns seconds until this model's buffer needs a flush on its own (None: nothing to wait for).
        """
        now = self.clock()
        offset = now - self.wallclock()  # epoch -> this process's monotonic clock
        delivery = _Delivery(ack=ack, remaining=len(request.items))
        buffer = self.buffers.get(request.model)
        if buffer is None:
            buffer = self.buffers[request.model] = BatchBuffer(self.policy)
        for item in request.items:
            entry = _Entry(
                BatchItem(id=item.id, request_id=request.id, input=item.input, deadline=request.deadline,
                          accepted_at=request.accepted_at, reply_to=request.reply_to),
                delivery,
            )
            buffer.add(entry, now=now, deadline=request.deadline + offset)
        self.stats["requests"] += 1
        self.stats["items"] += len(request.items)
        if request.model in self.held:
            return None  # already waiting for a worker; a full batch changes nothing
        if buffer.is_ready(now):
            self.flush(request.model)
            buffer = self.buffers.get(request.model)
            if buffer is None or request.model in self.held:
                return None
        return buffer.seconds_until_ready(self.clock())

    def discard_all(self) -> int:
        """Forget every buffered item without acknowledging it (the broker will redeliver them)."""
        count = sum(len(b.clear()) for b in self.buffers.values())
        self.buffers.clear()
        self.held.clear()
        return count

    # -- output --------------------------------------------------------------------------------------
    def poll(self) -> float | None:
        """Drop expired items and flush every ready batch; returns seconds until the next poll is needed.

        Models held for want of a worker are flushed only once their retry time is due.
        """
        for model in list(self.buffers):
            retry_at = self.held.get(model)
            if model not in self.held or (retry_at is not None and retry_at <= self.clock()):
                self.flush(model)
        now = self.clock()
        waits = [w for m, b in self.buffers.items()
                 if m not in self.held and (w := b.seconds_until_ready(now)) is not None]
        waits += [max(0.0, at - now) for at in self.held.values() if at is not None]
        return min(waits, default=None)

    def flush(self, model: str) -> int:
        """Send as many ready batches of ``model`` as there are; returns how many were sent."""
        buffer = self.buffers[model]
        now = self.clock()
        self._drop(buffer, now)
        sent = 0
        self.held.pop(model, None)
        workers: list[WorkerInfo] | None = None
        while buffer.is_ready(now):
            if workers is None:
                workers = self.live_workers()
            choice = self.scheduler.choose(workers, model, now)
            worker = choice.worker
            if worker is None:  # every worker is busy enough (or none is alive): keep accumulating
                self.held[model] = None if choice.retry_in_s is None else now + choice.retry_in_s
                log.debug("holding %d %s items: %d live workers, retry in %s s", len(buffer), model,
                          len(workers), choice.retry_in_s)
                break
            if self._drop(buffer, now + self.scheduler.batch_s(worker)):
                continue  # items that could not finish in time are gone: is a batch still due?
            pending = buffer.take()
            batch = self._batch(model, pending)
            try:
                self.dispatch(batch, worker)
            except Exception:
                log.exception("could not hand batch %s to %s; keeping its items", batch.id, worker.id)
                buffer.put_back(pending)
                self.held[model] = None
                break
            self.scheduler.sent(worker.id, batch.id, self.clock())
            for p in pending:
                p.item.delivery.resolve()
            self.stats["batches"] += 1
            self.stats["dispatched_items"] += len(pending)
            sent += 1
            now = self.clock()
        if not buffer:
            del self.buffers[model]
            self.held.pop(model, None)
        return sent

    def started(self, worker_id: str, batch_id: str) -> float | None:
        """A worker started a batch: its backlog estimate is now exact. Returns poll()'s delay."""
        self.scheduler.started(worker_id, batch_id, self.clock())
        return self.retry_held()

    def finished(self, worker_id: str, batch_id: str, run_s: float | None = None) -> float | None:
        """A worker finished a batch: its slot is free, so held batches may go now. Returns poll()'s delay."""
        self.scheduler.finished(worker_id, batch_id, run_s)
        return self.retry_held()

    def retry_held(self) -> float | None:
        """Ask the scheduler again for every held model (on news from the fleet, and periodically)."""
        for model in self.held:
            self.held[model] = self.clock()  # due now: poll() re-asks the scheduler
        return self.poll()

    def _drop(self, buffer: BatchBuffer[_Entry], horizon: float) -> int:
        """Drop items whose deadline falls before ``horizon``: their callers are gone by then anyway."""
        dropped = buffer.drop_expired(horizon)
        for entry in dropped:
            entry.delivery.resolve()
        self.stats["expired_items"] += len(dropped)
        return len(dropped)

    def _batch(self, model: str, pending: list[Pending[_Entry]]) -> Batch:
        return Batch(
            id=uuid.uuid4().hex, model=model, created_at=self.wallclock(),
            items=tuple(p.item.item for p in pending),
        )
