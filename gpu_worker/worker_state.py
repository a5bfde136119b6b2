"""What a worker knows of itself and reports in its heartbeat: when its batch started, its batch-time estimate,
what it completed, its recent device time and token rate; and the full-batch warm-up that gives the first estimate.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from gpu_worker.backends.interface import Backend
from tasks.schema import SamplingParams

log = logging.getLogger("llmb.worker")


class WorkerState:
    """What the heartbeat reports about this worker; updated by the runner, read by the heartbeat thread.
    ``clock`` is the fleet's shared wall clock (:class:`tasks.state.clock.SharedClock`): every time this worker
    compares with another host's (a caller's deadline) or reports (its heartbeat) is on it."""

    def __init__(self, ema_alpha: float = 0.2, window_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.alpha = ema_alpha
        self.batch_started_at: float | None = None
        self.batch_ms_estimate = 0.0
        self.completed = 0
        self.window_s = window_s
        self._recent: deque[tuple[float, float, int]] = deque()  # (finished at, run seconds, tokens)
        self._since = clock()

    def started(self, at: float) -> None:
        with self._lock:
            self.batch_started_at = at

    def finished(self, run_ms: float | None) -> None:
        with self._lock:
            self.batch_started_at = None
            self.completed += 1
            if run_ms is not None:
                est = self.batch_ms_estimate
                self.batch_ms_estimate = run_ms if est == 0 else est + self.alpha * (run_ms - est)

    def first_estimate(self, run_ms: float) -> None:
        """The batch time measured before serving (a warm-up): the estimate, not a completed batch."""
        with self._lock:
            self.batch_ms_estimate = run_ms

    def add_work(self, run_s: float, tokens: int, now: float) -> None:
        with self._lock:
            self._recent.append((now, run_s, tokens))

    def rates(self, now: float) -> tuple[float, float]:
        """(tokens per second, fraction of time busy) over the last ``window_s``. Busy time is the union of
        the batches' run intervals: batches that run at once (continuous batching's slots) count once."""
        with self._lock:
            while self._recent and now - self._recent[0][0] > self.window_s:
                self._recent.popleft()
            span = min(self.window_s, max(now - self._since, 1e-6))
            intervals = sorted((max(end - run, now - span), end) for end, run, _ in self._recent)
            tokens = sum(t for _, _, t in self._recent)
        busy, reach = 0.0, float("-inf")
        for start, end in intervals:
            if end > reach:
                busy += end - max(start, reach)
                reach = end
        return tokens / span, min(1.0, busy / span)

    def free_in_ms(self, now: float) -> float:
        """Estimated time until the running batch ends (0 when idle)."""
        with self._lock:
            if self.batch_started_at is None:
                return 0.0
            return max(0.0, self.batch_ms_estimate - (now - self.batch_started_at) * 1000)


def measure_full_batch(backend: Backend, state: WorkerState) -> None:
    """Time one full batch before the worker serves, as the first batch-time estimate it reports.

    Admission sizes its deadline cap from the workers' measured batch times; a worker that had measured
    nothing would leave the cap at its configured maximum, so a burst into a new fleet was admitted whole and
    answered 504 past the callers' deadlines (measured: 1,703 of 3,000 calls, 5 s deadline, one 250 ms worker).
    A failure here is logged and leaves the estimate unmeasured: the worker still serves."""
    inputs = ["warm-up"] * backend.max_batch
    started = time.perf_counter()
    try:
        backend.run(inputs, [SamplingParams(max_tokens=2, temperature=0)] * len(inputs))
    except Exception:
        log.exception("the full-batch warm-up failed; admission will size from the first real batch")
        return
    state.first_estimate((time.perf_counter() - started) * 1000)
