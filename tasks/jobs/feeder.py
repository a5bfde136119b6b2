"""``llmb-jobs``: runs the Batch API's jobs on spare capacity, feeding their lines through the same gateway as every
other request (same queue, tenant caps, fairness and poison isolation) at offline priority.

A :class:`Feeder` polls the database for jobs nobody runs (``tasks.store.jobs``: a lease per job, renewed every
poll, so two processes never run one job at once), takes a free slot's next job from the tenant running fewest
(:func:`tasks.policy.feeding.pick_jobs`), and runs each it claims in a thread of its own
(:class:`tasks.jobs.job_run.JobRun`):
validate the input file as it is read (:class:`tasks.policy.batchfile.InputCheck`: one pass that only checks,
then one that writes the lines, so neither holds the file), then keep a bounded window of lines in flight
(:class:`tasks.policy.feeding.FeedControl`: it grows while lines are admitted and answered promptly, halves and
pauses on 429 as Retry-After says, backs off on outages), commit finished lines in groups, and assemble the output
and error files once no line is pending. A cancelled job stops sending and lets its running lines finish. Every
``LLMB_FILES_CLEANUP_S`` the feeder also deletes expired files, what killed uploads left behind, and the lines of
ended jobs still in the database (at most ``SWEEP_LINES`` a pass).

What runs one line is given to the feeder (``run_line``: the API's own parsing and response shapes, composed in
:mod:`webapp.jobs`), so that this module knows nothing of HTTP.

Crashes: a killed process's lines in flight are simply not finished; its leases lapse after ``LLMB_JOBS_LEASE_S``
and the next process to claim the job sends the pending lines again, each with its idempotency key, so that one
the killed process had sent gets that sending's answer instead of a second run (the gateway marks a keyed call
before publishing it, so any sending that may have run is followed). A finished line (its output row
committed) is never sent again. SIGTERM stops sending, lets the lines in flight finish (for up to the lease
time), commits them and gives the leases up at once.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError

from tasks.config import Settings
from tasks.jobs.job_run import JobContext, JobRun, RunLine, TenantSlots, default_control
from tasks.policy.feeding import FeedControl, pick_jobs
from tasks.store.files import FileStore
from tasks.store.jobs import JobStore

log = logging.getLogger("llmb.jobs")

SWEEP_LINES = 50_000  # lines of ended jobs deleted per clean-up pass at most


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class Feeder:
    store: JobStore
    files: FileStore
    run_line: RunLine
    settings: Settings
    clock: Callable[[], float] = time.time  # epoch seconds, the same on every host (leases compare them)
    owner: str = field(default_factory=default_owner)
    control: Callable[[Settings], FeedControl] | None = None  # a job's feed control (default: from the settings)
    runs: dict[str, JobRun] = field(default_factory=dict, init=False)
    stopping: threading.Event = field(default_factory=threading.Event, init=False)
    pool: ThreadPoolExecutor = field(init=False)
    context: JobContext = field(init=False)  # what its job runs share
    _renewed_at: float = field(default=0.0, init=False)
    _cleaned_at: float = field(default=float("-inf"), init=False)

    def __post_init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, self.settings.jobs.max_in_flight),
                                       thread_name_prefix="line")
        self.context = JobContext(self.store, self.files, self.run_line, self.settings, self.clock, self.owner,
                                  self.control or default_control, TenantSlots(self.settings.jobs.max_in_flight),
                                  self.pool, self.stopping)

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set, then stop every job run (they finish their lines in flight)."""
        log.info("llmb-jobs %s: up to %d jobs at once, %d lines in flight per tenant, lease %g s", self.owner,
                 self.settings.jobs.max_active, self.settings.jobs.max_in_flight, self.settings.jobs.lease_s)
        while not stop.is_set():
            try:
                self.tick()
            except SQLAlchemyError as exc:
                log.warning("the database is unreachable (%s: %s); trying again in %g s", type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "", self.settings.jobs.poll_s)
            stop.wait(self.settings.jobs.poll_s)
        self.shutdown()

    def tick(self) -> None:
        """Renew the leases held, forget finished runs, claim new jobs while there is room."""
        now = self.clock()
        for job_id, run in list(self.runs.items()):
            if not run.thread.is_alive():
                del self.runs[job_id]
        if self.runs:
            self._renew(now)
        if self.stopping.is_set():
            return
        if now - self._cleaned_at >= self.settings.jobs.files_cleanup_s:
            self._cleaned_at = now
            self.clean_up()
        self._claim(now)

    def _renew(self, now: float) -> None:
        """Renew the leases of the jobs running here; a job whose lease could not be renewed in time is stopped."""
        lease_s = self.settings.jobs.lease_s
        try:
            held = self.store.renew(self.owner, list(self.runs), now, lease_s)
            self._renewed_at = now
        except SQLAlchemyError:
            held = set(self.runs) if now - self._renewed_at < lease_s / 2 else set()  # safe for a while
            if not held:
                log.warning("could not renew leases for %.1f s: stopping the jobs held", now - self._renewed_at)
        for job_id, run in self.runs.items():
            if job_id not in held:
                run.lost.set()

    def _claim(self, now: float) -> None:
        """Claim waiting jobs while there is room, shared fairly between tenants (:func:`pick_jobs`)."""
        lease_s = self.settings.jobs.lease_s
        room = self.settings.jobs.max_active - len(self.runs)
        if room <= 0:
            return
        waiting = [(j, t) for j, t in self.store.waiting(now, room) if j not in self.runs]
        for job_id in pick_jobs(waiting, self.store.running_by_tenant(now), room):
            if room <= 0:
                break
            if not self.store.claim(job_id, self.owner, now, lease_s):
                continue
            self._renewed_at = now
            run = JobRun(self.context, job_id)
            self.runs[job_id] = run
            log.info("took job %s", job_id)
            run.thread.start()
            room -= 1

    def clean_up(self) -> None:
        """Delete expired files (bytes and rows), temporary files that killed writes left behind, and the lines of
        ended jobs (a completed job's once it expires)."""
        swept = self.store.sweep_lines(self.clock(), SWEEP_LINES)
        if swept:
            log.info("deleted %d line(s) of ended batch jobs", swept)
        try:
            expired, leftovers = self.files.delete_expired(), self.files.sweep()
        except OSError as exc:
            log.warning("could not clean up the files folder %s (%s)", self.files.root, exc)
            return
        if expired or leftovers:
            log.info("deleted %d expired file(s) and %d unfinished upload(s)", expired, leftovers)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop sending, let the lines in flight finish (at most ``timeout_s``, by default the lease), commit them
        and give the leases up."""
        self.stopping.set()
        deadline = time.monotonic() + (self.settings.jobs.lease_s if timeout_s is None else timeout_s)
        while any(run.thread.is_alive() for run in self.runs.values()) and time.monotonic() < deadline:
            with contextlib.suppress(SQLAlchemyError):
                self.tick()  # renewing the leases of the jobs still finishing their lines (claiming nothing)
            for run in list(self.runs.values()):
                run.thread.join(max(0.0, min(self.settings.jobs.poll_s, deadline - time.monotonic())))
        self.pool.shutdown(wait=False, cancel_futures=True)
