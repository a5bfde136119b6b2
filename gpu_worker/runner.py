"""Runs one batch on the backend and writes every item's outcome: the body of the batch task.

Before running, the worker claims the batch (:mod:`tasks.state.claims`): a batch that was reassigned while this
worker was away, or already done, is skipped; one whose previous holder died while running it goes back to
the batcher to be split. Items whose caller's deadline has passed are dropped before the model runs.
Outputs are mapped back by position. A batch on which the model raises (or returns the wrong number of
outputs) also goes back to the batcher, which splits it to isolate the poison input; the worker never
answers its callers with a failure it cannot attribute.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Container
from typing import Any, TypeVar

import redis
from celery.exceptions import Reject

from gpu_worker.backends.interface import Backend, Hooks, ItemError, Output
from gpu_worker.device_slots import Device, Held
from gpu_worker.worker_state import WorkerState
from tasks import tracing
from tasks.schema import Batch, BatchEvent, BatchItem, EmbeddingOutput, Failure, GenerationOutput, ItemResult
from tasks.state.claims import Claims, ClaimVerdict
from tasks.state.results import ResultWriter
from tasks.store.ledger import BatchOutcome, ItemsOutcome, LedgerEvent

log = logging.getLogger("llmb.worker")
T = TypeVar("T")

GiveBack = Callable[[Batch, Failure, str, str], None]  # batch, failure, error, the worker id to blame
REDIS_RETRY_S = (0.1, 0.2, 0.5, 1.0)  # pauses between attempts while Redis is unreachable


class BatchRunner:
    """Runs batch tasks. ``run_id`` (``<worker id>/<token>``) names this process in batch claims.

    No batch task ends (and is acknowledged) before its outcome is settled: results written, handed back to
    the batchers, or its callers' deadlines passed. While Redis is unreachable it waits for Redis, within
    those deadlines; once :meth:`drain` was called (a graceful stop) batches not yet started are handed back.
    """

    def __init__(self, backend: Backend, writer: ResultWriter, worker_id: str, state: WorkerState, *,
                 announce: Callable[[BatchEvent], None], claims: Claims, give_back: GiveBack,
                 record: Callable[[LedgerEvent], None],
                 observe: Callable[[Any, int, float, int], None] = lambda pipe, size, run_s, tokens: None,
                 cancelled: Container[str] = frozenset(), run_id: str = "") -> None:
        self.backend = backend
        self.run_id = run_id or f"{worker_id}/{uuid.uuid4().hex[:12]}"
        self.draining = threading.Event()
        self._running: set[str] = set()  # batch ids this process is running now
        self.writer = writer
        self.worker_id = worker_id
        self.state = state
        self.announce = announce
        self.claims = claims
        self.give_back = give_back
        self.record = record
        self.observe = observe  # adds a batch to the metrics, inside the results pipeline
        self.cancelled = cancelled  # item ids whose callers went away
        # The device's slots. The worker runs a thread more than that (:data:`HOST_THREADS`): while a batch runs,
        # the last one's results are written and its task acknowledged, so the device does not wait for that.
        self.device = Device(backend.slots)

    def drain(self) -> None:
        """A graceful stop began: batches not started from now on are handed back, unstarted, to the batchers."""
        self.draining.set()

    def run(self, batch: Batch) -> dict[str, Any]:
        """Run the batch and write its results; the batchers hear when it starts and when it is done."""
        run_ms: float | None = None
        tokens: dict[str, int] | None = None
        try:
            summary = self._run(batch)
            run_ms, tokens = summary.get("run_ms"), summary.get("tokens_by_tenant")
            return summary
        except Reject:
            raise
        except Exception as exc:  # a defect of ours, not of the inputs: still, never ack a batch not settled
            log.exception("batch %s: unexpected failure; handing it back", batch.id, extra={"batch_id": batch.id})
            self._hand_back(batch, Failure.RAISED, f"the worker failed on this batch: {type(exc).__name__}: {exc}")
            return {"batch_id": batch.id, "given_back": "raised"}
        finally:
            self.announce(BatchEvent(self.worker_id, batch.id, "finished", run_ms, tokens))

    def _run(self, batch: Batch) -> dict[str, Any]:
        idle_s = self.device.idle_s()  # how late this batch came (0: the device is busy; it will wait for it)
        # Items another batch already answered: a batcher cut off from the broker sends, when its link comes
        # back, a batch its standby had re-formed and run meanwhile. Running them again would only cost the device.
        # Looked up before the device is free, while the last batch still runs: one Redis round trip less between
        # two runs (an item answered in between is run twice, and its caller still gets one answer).
        answered = self._until_settled(batch, lambda: self.writer.answered([i.id for i in batch.items]))
        if answered is None:  # Redis was away past every caller's deadline (recorded as expired): nothing to run
            return {"batch_id": batch.id, "size": len(batch.items), "dropped_expired": len(batch.items)}
        # The device is taken before the claim: a batch claimed here is one running (if this process dies, whoever
        # takes the batch back blames it), never one waiting for the device.
        device = Held(self.device)
        try:
            return self._claimed(batch, device, answered, idle_s)
        finally:
            device.release()

    def _claimed(self, batch: Batch, device: Held, answered: set[str], idle_s: float | None) -> dict[str, Any]:
        summary: dict[str, Any] = {"batch_id": batch.id, "size": len(batch.items)}
        if self.draining.is_set():
            log.info("batch %s: stopping; handing it back unstarted", batch.id, extra={"batch_id": batch.id})
            self._hand_back(batch, Failure.RETURNED, f"worker {self.worker_id} was stopping")
            return {**summary, "given_back": "returned"}
        claim = self._until_settled(batch, lambda: self.claims.for_run(batch.id, self.run_id))
        if claim is None:
            return {**summary, "dropped_expired": len(batch.items)}
        if claim.verdict is ClaimVerdict.SKIP or (claim.verdict is ClaimVerdict.MINE and batch.id in self._running):
            log.info("batch %s was reassigned, is running here or is done; skipping it", batch.id,
                     extra={"batch_id": batch.id})
            return {**summary, "skipped": True}
        if claim.verdict is ClaimVerdict.DIED:
            log.warning("batch %s: its previous worker (%s) died running it; handing it back for isolation",
                        batch.id, claim.owner, extra={"batch_id": batch.id})
            self._hand_back(batch, Failure.DIED, f"the worker running this batch ({claim.worker}) died",
                            blame=claim.worker)
            return {**summary, "given_back": "died"}
        self._running.add(batch.id)
        try:
            return self._execute(batch, summary, device, answered, idle_s)
        finally:
            self._running.discard(batch.id)

    def _execute(self, batch: Batch, summary: dict[str, Any], device: Held, answered: set[str],
                 idle_s: float | None) -> dict[str, Any]:
        # Items whose caller will be gone before this batch can finish are not worth running.
        horizon = self.state.clock() + self.state.batch_ms_estimate / 1000
        live = tuple(i for i in batch.items if i.deadline > horizon)
        expired = [i for i in batch.items if i.deadline <= horizon]
        if expired:
            self.record(ItemsOutcome(batch.model, expired, "expired", "deadline passed before the batch ran",
                                     batch.id))
        answered = {i.id for i in live if i.id in answered}
        if answered:
            log.info("batch %s: %d item(s) already answered by another batch; not running them", batch.id,
                     len(answered), extra={"batch_id": batch.id})
            live = tuple(i for i in live if i.id not in answered)
        summary.update(size=len(live), dropped_expired=len(expired), already_answered=len(answered))
        if not live:
            self._until_settled(batch, lambda: self.writer.mark_done(self.claims.key(batch.id)))
            return summary

        failure: Exception | None = None
        with device:  # given up once the batch has run: writing its results overlaps the next batch's run
            started_at = self.state.clock()
            t0 = time.monotonic()
            self.state.started(started_at)
            self.announce(BatchEvent(self.worker_id, batch.id, "started", at=started_at,
                                     idle_ms=None if idle_s is None else round(idle_s * 1000, 3)))
            early: set[int] = set()  # positions answered as they finished, before the batch did
            try:
                hooks = self._hooks(live, batch.id, started_at, t0, early)
                outputs = self.backend.run([i.input for i in live], [i.params for i in live], hooks)
                if len(outputs) != len(live):
                    raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(live)} inputs")
            except Exception as exc:  # the model is a black box: any failure sends the batch back for isolation
                failure = exc
            run_ms = (time.monotonic() - t0) * 1000
            self.state.finished(None if failure else run_ms)
        if failure is not None:
            error = f"the model raised {type(failure).__name__}: {failure}"
            log.warning("batch %s (size %d) failed: %s; handing it back to be split", batch.id, len(live), error,
                        extra={"batch_id": batch.id})
            ran = batch.with_items(live)
            self._hand_back(ran, Failure.RAISED, error)
            self.record(BatchOutcome(ran, "raised", "retrying", self.worker_id, error, started_at, self.state.clock(),
                                     round(run_ms, 3)))
            return {**summary, "given_back": "raised", "run_ms": None}

        common: dict[str, Any] = dict(batch_id=batch.id, batch_size=len(live), worker=self.worker_id,
                                      started_at=started_at, run_ms=round(run_ms, 3))
        results = [ItemResult(error=o.type, message=o.message, **common) if isinstance(o, ItemError)
                   else ItemResult(output=_wire(o), **common) for o in outputs]
        generated = [(item, o) for item, o in zip(live, outputs) if isinstance(o, GenerationOutput)]
        by_tenant: dict[str, int] = {}  # what fairness charges each tenant, corrected from its estimate
        for item, o in generated:
            by_tenant[item.tenant] = by_tenant.get(item.tenant, 0) + o.tokens
        tokens = sum(o.tokens for o in outputs if isinstance(o, (GenerationOutput, EmbeddingOutput)))
        self.state.add_work(run_ms / 1000, tokens, self.state.clock())
        def write() -> bool:
            self.writer.write([(i, r) for p, (i, r) in enumerate(zip(live, results)) if p not in early],
                              done_key=self.claims.key(batch.id),
                              extra=lambda pipe: self.observe(pipe, len(live), run_ms / 1000, tokens))
            return True

        if self._until_settled(batch, write) is None:  # Redis was away past every deadline: nobody waits now
            return {**summary, "run_ms": round(run_ms, 1), "unwritten": len(live)}
        tracing.run_spans(batch, live, self.worker_id, started_at, started_at + run_ms / 1000, self.state.clock())
        rejected = [i for i, o in zip(live, outputs) if isinstance(o, ItemError)]
        if rejected:  # recorded first: the batch's "ok" below does not override a final status
            self.record(ItemsOutcome(batch.model, rejected, "rejected", "the model could not take this input",
                                     batch.id))
        counted = {item.id: (o.prompt_tokens, o.completion_tokens) for item, o in generated}
        self.record(BatchOutcome(batch.with_items(live), "ok", "ok", self.worker_id, None, started_at,
                                 self.state.clock(), round(run_ms, 3), counted or None))
        log.info("batch %s size=%d run_ms=%.1f dropped=%d", batch.id, len(live), run_ms, len(expired),
                 extra={"batch_id": batch.id, "size": len(live), "run_ms": round(run_ms, 1),
                        "trace_id": tracing.trace_id(batch.trace)})
        return {**summary, "run_ms": round(run_ms, 1), **({"tokens_by_tenant": by_tenant} if by_tenant else {})}

    def _hooks(self, live: tuple[BatchItem, ...], batch_id: str, started_at: float, t0: float,
               early: set[int]) -> Hooks:
        """Streaming, cancellation and early answers for generating backends, by position in the batch."""
        offsets: dict[int, int] = {}  # characters of each row's text streamed so far

        def stream(deltas: list[tuple[int, str]]) -> None:
            pieces = []
            for p, text in deltas:
                pieces.append((live[p], offsets.get(p, 0), text))
                offsets[p] = offsets.get(p, 0) + len(text)
            try:
                self.writer.stream(pieces)
            except redis.RedisError as exc:  # the final result still carries the whole text
                log.warning("could not stream text: %s", exc)

        def done(p: int, output: Output) -> None:
            """A row finished while others of its batch run on: answer its caller now, not when the longest row
            ends. Best effort: if Redis refuses, the batch's final write answers it. A rerun of the batch (a
            fault later) skips it: it has an answer."""
            if isinstance(output, ItemError) or p in early:
                return
            result = ItemResult(output=_wire(output), batch_id=batch_id, batch_size=len(live), worker=self.worker_id,
                                started_at=started_at, run_ms=round((time.monotonic() - t0) * 1000, 3))
            try:
                self.writer.write([(live[p], result)])
                early.add(p)
            except redis.RedisError as exc:
                log.warning("could not answer item %s early: %s", live[p].id, exc)

        return Hooks(streaming={p for p, i in enumerate(live) if i.params.stream}, stream=stream,
                     cancelled=lambda p: live[p].id in self.cancelled, done=done)

    def _hand_back(self, batch: Batch, failure: Failure, error: str, blame: str = "") -> None:
        """Give the batch back to the batchers; if that fails, requeue it so nothing is lost."""
        try:
            self.give_back(batch, failure, error, blame or self.worker_id)
        except Exception as exc:
            log.error("could not hand batch %s back (%s); requeueing it", batch.id, exc)
            with contextlib.suppress(redis.RedisError):
                self.claims.restore(batch.id, self.run_id)  # its redelivery is then "mine": run again, no blame
            time.sleep(REDIS_RETRY_S[-1])  # the broker or Redis is away: do not spin on the redelivery
            raise Reject(f"could not hand the batch back: {exc}", requeue=True) from exc
        try:
            self.claims.give_back(batch.id)
        except redis.RedisError as exc:  # the recovery queue has it; a stray redelivery would be re-run, harmlessly
            log.warning("could not mark batch %s handed back: %s", batch.id, exc)

    def _until_settled(self, batch: Batch, call: Callable[[], T]) -> T | None:
        """``call()``, retried while Redis is unreachable; None once every item's deadline has passed.

        A batch task that returned is acknowledged, so returning early on a Redis error would lose the batch:
        its results could never be written and nobody would run it again.
        """
        last = max(i.deadline for i in batch.items)
        for attempt in itertools.count():
            try:
                return call()
            except redis.RedisError as exc:
                if self.state.clock() > last:
                    log.error("batch %s: Redis unreachable until every caller's deadline passed (%s); dropping it",
                              batch.id, exc, extra={"batch_id": batch.id})
                    self.record(ItemsOutcome(batch.model, list(batch.items), "expired",
                                             f"Redis unreachable: {exc}", batch.id))
                    return None
                pause = REDIS_RETRY_S[min(attempt, len(REDIS_RETRY_S) - 1)]
                log.warning("batch %s: Redis unreachable (%s); retrying in %g s", batch.id, exc, pause,
                            extra={"batch_id": batch.id})
                time.sleep(pause)
        raise AssertionError("unreachable")


def _wire(output: Output) -> object:
    """An output as its result carries it: the JSON object a typed output was before it had a type."""
    return output.to_dict() if isinstance(output, (GenerationOutput, EmbeddingOutput)) else output
