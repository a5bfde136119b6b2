"""One batch job, run by one thread of ``llmb-jobs`` while its :class:`tasks.jobs.feeder.Feeder` holds the job's
lease: validate the input file, keep a window of lines in flight, commit finished lines in groups, write the
output and error files (the module docstring of :mod:`tasks.jobs.feeder` tells the whole loop).

A run is given what the feeder's runs share as one :class:`JobContext`, so it knows nothing of the feeder and the
imports go one way (the feeder imports this module)."""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from tasks.config import Settings
from tasks.policy.batchfile import InputCheck, InputLine, LineError, error_line, output_file_id, response_line
from tasks.policy.feeding import Disposition, FeedControl, disposition, gives_up
from tasks.store.files import FileStore
from tasks.store.jobs import JobInfo, JobStore, Line, LineOutcome

log = logging.getLogger("llmb.jobs")

REFILL = 500  # pending lines read from the database at a time
COMMIT_EVERY_S = 0.1  # finished lines are committed in groups, at least this often
COMMIT_MAX = 500
PROGRESS_EVERY_S = 10.0  # a progress line per running job in the log


@dataclass(frozen=True)
class LineResult:
    """What running one line gave: an HTTP status and body, as the endpoint would have answered it (for the output
    file), and its error's type (None: it succeeded), which decides what becomes of the line."""

    status_code: int
    body: Any
    error_type: str | None = None
    retry_after_s: float | None = None
    ran: bool = True  # it ran on a worker now (not refused at the door, nor an earlier run's answer replayed)


# (job, line, generation) -> its answer; the generation counts the line's runs whose deadline passed in this process
# (each one is a new run: a runner keying lines for idempotency gives each generation a key of its own)
RunLine = Callable[[JobInfo, Line, int], LineResult]


def default_control(settings: Settings) -> FeedControl:
    return FeedControl(initial=settings.jobs.initial_in_flight, ceiling=settings.jobs.max_in_flight)


class TenantSlots:
    """Lines in flight per tenant across one process's jobs, at most ``limit`` each: how many a job may send now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, wanted: int) -> int:
        """Up to ``wanted`` slots of ``tenant``'s, held until given back; how many were granted."""
        with self._lock:
            held = self._held.get(tenant, 0)
            granted = max(0, min(wanted, self.limit - held))
            self._held[tenant] = held + granted
            return granted

    def give(self, tenant: str, n: int = 1) -> None:
        with self._lock:
            self._held[tenant] = self._held.get(tenant, 0) - n


@dataclass(frozen=True)
class JobContext:
    """What every job run of one process shares, handed to each by the feeder that holds their leases."""

    store: JobStore
    files: FileStore
    run_line: RunLine
    settings: Settings
    clock: Callable[[], float]  # epoch seconds (leases and expiry compare them)
    owner: str  # the leases' holder: this process
    control: Callable[[Settings], FeedControl]  # a job's feed control
    slots: TenantSlots
    pool: Executor  # runs the lines
    stopping: threading.Event  # the process is stopping: send no more, finish what is in flight


@dataclass
class _Sent:
    line: Line
    sent_at: float  # monotonic
    attempts: int


class JobRun:
    """One job, run by one thread while its feeder holds the lease."""

    def __init__(self, context: JobContext, job_id: str) -> None:
        self.context = context
        self.store = context.store
        self.job_id = job_id
        self.lost = threading.Event()  # the lease is gone: stop sending, another process may have the job
        self.thread = threading.Thread(target=self._main, name=f"job-{job_id}", daemon=True)
        self.control = context.control(context.settings)
        self.answers: queue.Queue[tuple[_Sent, LineResult | None]] = queue.Queue()
        self.in_flight: dict[int, _Sent] = {}
        self.attempts: dict[int, int] = {}
        self.generation: dict[int, int] = {}  # line -> its runs that ended past their deadline
        self.todo: deque[Line] = deque()
        self.finished: list[LineOutcome] = []
        self._cursor, self._exhausted = -1, False  # the last line read from the database; whether none are left
        self.tenant = ""  # the job's, once read
        self.replayed = 0  # lines answered with an earlier run's answer (sent again after a crash)

    # -- the run -----------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            job = self.store.get(self.job_id)
            if job is None:
                return
            self.tenant = job.tenant
            if job.status == "validating":
                job = self._validate(job)
            if job is not None and job.status in ("in_progress", "cancelling"):
                end = self._feed(job)
                if end is not None:
                    self._finalize(job, end)
            elif job is not None and job.status == "finalizing":
                self._finalize(job, "completed")
        except Exception:
            log.exception("job %s failed in this process; its lease lapses and it is taken up again", self.job_id)
        finally:
            self._wait_in_flight(self.context.settings.jobs.lease_s)

    def _check(self, job: JobInfo) -> InputCheck:
        s = self.context.settings
        return InputCheck(job.endpoint, s.jobs.max_lines, s.admission.max_body_bytes)

    def _validate(self, job: JobInfo) -> JobInfo | None:
        """Check the input file in one pass that keeps nothing but its errors, then write its lines in a second
        pass, as they are read: memory is one line and the custom_ids' digests, whatever the file's size. A job
        that cannot be validated (past its expiry, its file or its bytes gone, over its tenant's lines) fails
        saying why, instead of being taken up again every lease."""
        now = self.context.clock()
        written: int | None = None
        try:
            reason = self._unrunnable(job, now)
            if reason is None:
                errors, n_lines = self._errors(job)
                reason = errors or self._over_lines(job, n_lines, now)
            if not reason:
                with self.context.files.open(job.input_file_id) as f:
                    written = self.store.start(job.id, self.context.owner, self._unchanged(job, f), now)
        except FileNotFoundError:
            reason = [LineError(0, "invalid_file", f"the content of the input file {job.input_file_id!r} is missing "
                                                   "(its upload did not complete, or it was deleted)")]
        if reason:
            self.store.fail(job.id, self.context.owner, reason, now)
            log.info("job %s failed validation: %d error(s), first: %s", job.id, len(reason), reason[0].message)
            return None
        if written is None:
            return self.store.get(job.id)  # cancelled meanwhile, or the lease was lost
        log.info("job %s: %d lines to run against %s for tenant %s", job.id, written, job.endpoint, job.tenant)
        return self.store.get(job.id)

    def _unrunnable(self, job: JobInfo, now: float) -> list[LineError] | None:
        """Why the job cannot even be checked: past its expiry, or its input file gone."""
        if now >= job.expires_at:
            return [LineError(0, "batch_expired", "the batch's completion window ended before its input file "
                                                  "could be validated")]
        if self.context.files.get(job.tenant, job.input_file_id) is None:
            return [LineError(0, "invalid_file", f"the input file {job.input_file_id!r} does not exist")]
        return None

    def _over_lines(self, job: JobInfo, n_lines: int, now: float) -> list[LineError]:
        """The error when the job's lines would take its tenant over LLMB_JOBS_TENANT_MAX_LINES."""
        bound = self.context.settings.jobs.tenant_max_lines
        held = self.store.held(job.tenant, now, besides=job.id)[1] if bound else 0
        if not bound or held + n_lines <= bound:
            return []
        return [LineError(0, "too_many_lines", f"its {n_lines} lines would take tenant {job.tenant!r} over its "
                                               f"bound of {bound} batch lines (it holds {held}; "
                                               "LLMB_JOBS_TENANT_MAX_LINES)")]

    def _errors(self, job: JobInfo) -> tuple[list[LineError], int]:
        """The first pass: what is wrong with the file, and how many requests it holds (its check, and the
        custom_ids it remembers, are let go before the second pass remembers them again)."""
        check = self._check(job)
        with self.context.files.open(job.input_file_id) as f:
            for _ in check.lines(f):
                pass
        return check.report(), check.requests

    def _unchanged(self, job: JobInfo, f: Any) -> Iterator[InputLine]:
        """The lines of a file checked already; an error now (the file changed under us) undoes the writing."""
        check = self._check(job)
        yield from check.lines(f)
        if check.report():
            raise RuntimeError(f"the input file {job.input_file_id} changed while job {job.id} was validated")

    def _feed(self, job: JobInfo) -> str | None:
        """Send every pending line; returns how the job ends ("completed", "cancelled", "expired"), or None when
        this process must stop running it (lease lost, shutting down)."""
        settings = self.context.settings
        self._cursor, self._exhausted = -1, False
        committed_at = time.monotonic()
        checked_at = 0.0
        ending: str | None = "cancelled" if job.status == "cancelling" else None
        reported_at = time.monotonic()
        while True:
            now = time.monotonic()
            if now - reported_at >= PROGRESS_EVERY_S:
                reported_at = now
                log.info("job %s: %d lines in flight (window %.0f), %d waiting to be sent, pause %.1f s", job.id,
                         len(self.in_flight), self.control.window, len(self.todo), self.control.wait_s(now))
            if now - checked_at >= settings.jobs.poll_s:
                checked_at = now
                ending = self._ending(job, ending)
            stop = self.lost.is_set() or self.context.stopping.is_set()
            if ending is None and not stop:
                self._refill(job)
                self._send(job, now)
            self._collect(min(0.05, self.control.wait_s(now) or 0.05))
            if self._commit_due(committed_at):
                self._commit()
                committed_at = time.monotonic()
            if self.in_flight or self.finished:
                continue
            if stop or ending == "gone":
                return None
            if ending is not None:
                return ending
            if self._exhausted and not self.todo:
                if self.store.count(job.id, "pending") == 0:
                    return "completed"
                self._cursor, self._exhausted = -1, False  # lines left behind (none expected): read them again

    def _ending(self, job: JobInfo, ending: str | None) -> str | None:
        """How the job is to end as its row says now (cancelled, gone, expired), or None to go on."""
        status = self.store.status(job.id)
        if status == "cancelling":
            ending = "cancelled"
        elif status != "in_progress":
            ending = ending or "gone"
        if ending is None and self.context.clock() >= job.expires_at:
            ending = "expired"
        return ending

    def _refill(self, job: JobInfo) -> None:
        """Read the next pending lines from the database once fewer than the window (or half a refill) are left."""
        if self._exhausted or len(self.todo) >= max(REFILL // 2, int(self.control.window)):
            return
        more = self.store.pending(job.id, self._cursor, REFILL)
        self.todo.extend(x for x in more if x.line_no not in self.in_flight)
        self._cursor = more[-1].line_no if more else self._cursor
        self._exhausted = len(more) < REFILL

    def _commit_due(self, committed_at: float) -> bool:
        """Whether the finished lines are to be written now: enough of them, long enough, or nothing in flight."""
        return bool(self.finished) and (len(self.finished) >= COMMIT_MAX or not self.in_flight
                                        or time.monotonic() - committed_at >= COMMIT_EVERY_S)

    def _send(self, job: JobInfo, now: float) -> None:
        room = min(self.control.room(len(self.in_flight), now), len(self.todo))
        if room <= 0:
            return
        granted = self.context.slots.take(job.tenant, room)
        for _ in range(granted):
            line = self.todo.popleft()
            sent = _Sent(line, time.monotonic(), self.attempts.get(line.line_no, line.attempts) + 1)
            self.attempts[line.line_no] = sent.attempts
            self.in_flight[line.line_no] = sent
            try:
                self.context.pool.submit(self._run_one, job, sent)
            except RuntimeError:  # the pool is shut down: the process is stopping
                self.in_flight.pop(line.line_no)
                self.context.slots.give(job.tenant)
                self.todo.appendleft(line)
                return

    def _run_one(self, job: JobInfo, sent: _Sent) -> None:
        try:
            result: LineResult | None = self.context.run_line(job, sent.line,
                                                              self.generation.get(sent.line.line_no, 0))
        except Exception:
            log.exception("line %s of job %s: unexpected error", sent.line.line_no, job.id)
            result = None
        self.answers.put((sent, result))

    def _collect(self, wait_s: float) -> None:
        try:
            first = self.answers.get(timeout=max(0.001, wait_s))
        except queue.Empty:
            return
        items = [first]
        while True:
            try:
                items.append(self.answers.get_nowait())
            except queue.Empty:
                break
        for sent, result in items:
            self._answered(sent, result)

    def _answered(self, sent: _Sent, result: LineResult | None) -> None:
        line = sent.line
        self.in_flight.pop(line.line_no, None)
        self.context.slots.give(self.tenant)
        now = time.monotonic()
        if result is None:  # an error of ours, not an answer
            result = LineResult(500, {"error": {"message": "internal error running this line", "type":
                                                "server_error", "param": None, "code": "internal_error"}},
                                "internal_error")
        d = disposition(result.error_type)
        if result.error_type == "deadline_exceeded":
            self.generation[line.line_no] = self.generation.get(line.line_no, 0) + 1
        window = self.control.window
        if d is Disposition.REFUSED:
            self.control.refused(sent.sent_at, result.retry_after_s, now)
        elif d is not Disposition.FINAL:
            self.control.failed(sent.sent_at, now)
        if d is not Disposition.FINAL and self.control.window < window:
            log.info("job %s: %d %s: %.0f lines in flight at most now (was %.0f), sending again in %.1f s",
                     self.job_id, result.status_code, result.error_type, self.control.window, window,
                     self.control.wait_s(now))
        if d is Disposition.FINAL:
            ran = result.ran and result.error_type is None
            self.replayed += not result.ran
            self.control.answered(now - sent.sent_at if ran else None, now)
        if gives_up(d, sent.attempts):
            output = response_line(line.request_id, line.custom_id, result.status_code, result.body)
            self.finished.append(LineOutcome(line.line_no, result.error_type is None, result.status_code, output,
                                             sent.attempts))
        else:
            self.todo.appendleft(line)  # first in line once the job may send again

    def _commit(self) -> None:
        batch, self.finished = self.finished, []
        try:
            self.store.record(self.job_id, batch, self.context.clock())
        except SQLAlchemyError as exc:
            log.warning("could not commit %d finished line(s) of job %s (%s); retrying", len(batch), self.job_id,
                        type(exc).__name__)
            self.finished = batch + self.finished
            time.sleep(0.5)

    def _wait_in_flight(self, timeout_s: float) -> None:
        """Let the lines still in flight finish and commit them (a stop, a lost lease, an error)."""
        deadline = time.monotonic() + timeout_s
        while (self.in_flight or self.finished) and time.monotonic() < deadline:
            if self.in_flight:
                self._collect(0.1)
            if self.finished:
                self._commit()
        if self.lost.is_set() or not self.context.stopping.is_set():
            return
        with contextlib.suppress(SQLAlchemyError):  # it lapses
            self.store.release(self.job_id, self.context.owner)

    # -- the end ---------------------------------------------------------------------------------------------
    def _finalize(self, job: JobInfo, end: str) -> None:
        """Write the output and error files from the committed lines, then mark the job done."""
        owner, now = self.context.owner, self.context.clock()
        if end == "completed":
            self.store.finalizing(job.id, owner, now)
        job = self.store.get(job.id) or job
        code, message = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
                         "expired": ("batch_expired", "the batch expired before this request ran")
                         }.get(end, ("", ""))

        def lines(want_ok: bool) -> Iterator[bytes]:
            for _, custom_id, request_id, status, output in self.store.all_lines(job.id):
                if (status == "ok" and want_ok) or (status == "error" and not want_ok):
                    yield (output or "").encode() + b"\n"
                elif status == "pending" and not want_ok:
                    yield error_line(request_id, custom_id, code or "batch_failed", message or "not run").encode() \
                        + b"\n"

        counts = self.store.counts(job.id)
        out_id = err_id = None
        expires = job.output_expires_s
        if counts.get("ok"):
            out_id = output_file_id(job.id, "output")
            self.context.files.put(out_id, job.tenant, "batch_output", f"{job.id}_output.jsonl", lines(True), expires)
        if counts.get("error") or counts.get("pending"):
            err_id = output_file_id(job.id, "error")
            self.context.files.put(err_id, job.tenant, "batch_output", f"{job.id}_error.jsonl", lines(False), expires)
        if self.store.finish(job.id, owner, end, out_id, err_id, self.context.clock()):
            log.info("job %s %s: %d ok, %d errors, %d not run (%d answered here by the run of an earlier process)",
                     job.id, end, counts.get("ok", 0), counts.get("error", 0), counts.get("pending", 0),
                     self.replayed)

