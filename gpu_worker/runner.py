"""Runs one batch on the backend and writes every item's outcome: the body of the batch task.

Items whose caller's deadline has already passed are dropped before the model runs. Outputs are mapped back
by position; a length mismatch or an exception fails the whole batch, and each of its items gets an error
result (never silence: a caller must not wait for an output that will not come).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from collections.abc import Callable

from gpu_worker.backends import Backend
from tasks.fleet import BatchEvent
from tasks.results import ResultWriter
from tasks.schema import Batch, ItemResult

log = logging.getLogger("llmb.worker")


class WorkerState:
    """What the heartbeat reports about this worker; updated by the runner, read by the heartbeat thread."""

    def __init__(self, ema_alpha: float = 0.2) -> None:
        self._lock = threading.Lock()
        self.alpha = ema_alpha
        self.batch_started_at: float | None = None
        self.batch_ms_estimate = 0.0
        self.completed = 0

    def started(self, at: float) -> None:
        with self._lock:
            self.batch_started_at = at

    def finished(self, run_ms: float) -> None:
        with self._lock:
            self.batch_started_at = None
            self.completed += 1
            est = self.batch_ms_estimate
            self.batch_ms_estimate = run_ms if est == 0 else est + self.alpha * (run_ms - est)


class BatchRunner:
    def __init__(self, backend: Backend, writer: ResultWriter, worker_id: str, state: WorkerState,
                 announce: Callable[[BatchEvent], None]) -> None:
        self.backend = backend
        self.writer = writer
        self.worker_id = worker_id
        self.state = state
        self.announce = announce

    def run(self, batch: Batch) -> dict[str, Any]:
        """Run the batch and write its results; the batchers hear when it starts and when it is done."""
        run_ms: float | None = None
        try:
            summary = self._run(batch)
            run_ms = summary.get("run_ms")
            return summary
        finally:
            self.announce(BatchEvent(self.worker_id, batch.id, "finished", run_ms))

    def _run(self, batch: Batch) -> dict[str, Any]:
        now = time.time()
        live = [i for i in batch.items if i.deadline > now]
        dropped = len(batch.items) - len(live)
        summary: dict[str, Any] = {"batch_id": batch.id, "size": len(live), "dropped_expired": dropped}
        if not live:
            log.info("batch %s: all %d items expired before it ran; dropped", batch.id, dropped,
                     extra={"batch_id": batch.id})
            return summary
        started_at = time.time()
        t0 = time.monotonic()
        self.state.started(started_at)
        self.announce(BatchEvent(self.worker_id, batch.id, "started"))
        error: str | None = None
        try:
            outputs = self.backend.run([i.input for i in live])
            if len(outputs) != len(live):
                raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(live)} inputs")
        except Exception as exc:  # the model is a black box: any failure fails this batch, not the worker
            log.exception("batch %s failed on %s", batch.id, self.worker_id, extra={"batch_id": batch.id})
            error = f"the model raised {type(exc).__name__}: {exc}"
            outputs = [None] * len(live)
        run_ms = (time.monotonic() - t0) * 1000
        self.state.finished(run_ms)
        common = dict(batch_id=batch.id, batch_size=len(live), worker=self.worker_id, started_at=started_at,
                      run_ms=round(run_ms, 3))
        results = [
            ItemResult(output=o, **common) if error is None
            else ItemResult(error="inference_failed", message=error, **common)  # type: ignore[arg-type]
            for o in outputs
        ]
        self._write(list(zip(live, results)))
        summary.update(run_ms=round(run_ms, 1), failed=error is not None)
        log.info("batch %s size=%d run_ms=%.1f dropped=%d%s", batch.id, len(live), run_ms, dropped,
                 " FAILED" if error else "", extra={"batch_id": batch.id, "size": len(live), "run_ms": run_ms})
        return summary

    def _write(self, pairs: list[tuple[Any, ItemResult]], attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            try:
                self.writer.write(pairs)
                return
            except redis.RedisError as exc:
                if attempt == attempts:
                    raise
                log.warning("writing results failed (%s); retrying", exc)
                time.sleep(0.2 * attempt)
