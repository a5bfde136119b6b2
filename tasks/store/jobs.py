"""Batch jobs and their lines in SQL (tables ``batch_jobs`` and ``batch_lines``): what the Batch API shows, what
``llmb-jobs`` runs, and the leases that keep two ``llmb-jobs`` processes from running one job at once.

A job's life::

    validating -> in_progress -> finalizing -> completed
        |              |
        v              v
      failed       cancelling -> cancelled          (and, past its completion window, expired)

- **Leases.** A process runs a job only while it holds the job's lease (``lease_owner``, ``lease_until``, taken
  and renewed by compare-and-set ``UPDATE`` statements, so on SQLite and PostgreSQL alike one process wins). A
  process that dies stops renewing; the lease lapses and another process (or the same one restarted) takes the
  job over where it stood.
- **Lines.** Validation writes every line (``pending``) and moves the job to ``in_progress`` in one transaction,
  taking the lines one at a time from the file as it is read (a job's size is never held in memory).
  A line is finished once its output row is committed (``ok`` or ``error``, with the output file line it
  produced); :meth:`JobStore.record` only ever moves a line out of ``pending``, so it is written once, whoever
  ran it and however often. A job resumed after a crash sends only the lines still pending.
- **Output files** are assembled from the rows once no line is pending, then the job is marked done; a crash in
  between assembles them again (the files have fixed ids).
- **Bounds per tenant.** A tenant has at most ``LLMB_JOBS_TENANT_MAX_ACTIVE`` jobs not yet ended (one more is
  refused at create, 403 ``quota_exceeded``) and holds at most ``LLMB_JOBS_TENANT_MAX_LINES`` rows of
  ``batch_lines`` (a job that would take it over fails validation, saying so). A job's rows are deleted when it
  ends, in the transaction that records its end (its output files are written by then), except a completed job's,
  kept until its expiry for ``llmb-admin jobs show --lines``; ``llmb-jobs`` sweeps those, and what earlier
  versions kept of ended jobs (:meth:`JobStore.sweep_lines`, bounded per pass).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import and_, delete, func, insert, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from tasks.config import Settings
from tasks.errors import QuotaExceeded
from tasks.policy.batchfile import COMPLETION_WINDOWS, MAX_ERRORS, InputLine, LineError, line_request_id, new_id
from tasks.store.models import BatchJobRecord, BatchLineRecord, make_engine

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a job some llmb-jobs process must run
CANCELLABLE = ("validating", "in_progress")
FINAL = ("completed", "failed", "cancelled", "expired")
INSERT_CHUNK = 500  # lines written per statement...
INSERT_CHUNK_BYTES = 1024 * 1024  # ...or fewer, when their bodies add up to this much
DELETE_CHUNK = 5000  # lines deleted per statement (a sweep's pass deletes at most its limit)


@dataclass(frozen=True)
class JobInfo:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    metadata: dict[str, Any] | None
    errors: list[dict[str, Any]] | None
    total: int
    completed: int
    failed: int
    output_file_id: str | None
    error_file_id: str | None
    created_at: float
    expires_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    expired_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    lease_owner: str | None
    lease_until: float | None
    output_expires_s: int | None = None  # its output files' expiry after their creation (None: the default)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's Batch object."""

        def epoch(value: float | None) -> int | None:
            return None if value is None else int(value)

        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window, "status": self.status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": int(self.created_at), "in_progress_at": epoch(self.in_progress_at),
            "expires_at": epoch(self.expires_at), "finalizing_at": epoch(self.finalizing_at),
            "completed_at": epoch(self.completed_at), "failed_at": epoch(self.failed_at),
            "expired_at": epoch(self.expired_at), "cancelling_at": epoch(self.cancelling_at),
            "cancelled_at": epoch(self.cancelled_at),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Line:
    """A pending line, as the feeder sends it."""

    job_id: str
    line_no: int
    custom_id: str
    request_id: str
    body: str  # JSON
    attempts: int


@dataclass(frozen=True)
class LineOutcome:
    """A line's final answer: ``ok`` (200, for the output file) or not (for the error file)."""

    line_no: int
    ok: bool
    status_code: int
    output: str  # the file line, JSON
    attempts: int


def _job(r: BatchJobRecord) -> JobInfo:
    return JobInfo(
        id=r.id, tenant=r.tenant, endpoint=r.endpoint, input_file_id=r.input_file_id,
        completion_window=r.completion_window, status=r.status,
        metadata=json.loads(r.meta) if r.meta else None, errors=json.loads(r.errors) if r.errors else None,
        total=r.total, completed=r.completed, failed=r.failed, output_file_id=r.output_file_id,
        error_file_id=r.error_file_id, created_at=r.created_at, expires_at=r.expires_at,
        in_progress_at=r.in_progress_at, finalizing_at=r.finalizing_at, completed_at=r.completed_at,
        failed_at=r.failed_at, expired_at=r.expired_at, cancelling_at=r.cancelling_at, cancelled_at=r.cancelled_at,
        lease_owner=r.lease_owner, lease_until=r.lease_until, output_expires_s=r.output_expires_s)


class JobStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None) -> JobStore:
        return cls(engine or make_engine(settings.stores.database_url))

    # -- the API's side ----------------------------------------------------------------------------------
    def create(self, tenant: str, endpoint: str, input_file_id: str, completion_window: str,
               metadata: dict[str, Any] | None, now: float, output_expires_s: int | None = None, *,
               max_active: int = 0, max_lines: int = 0) -> JobInfo:
        """A new job, ``validating``. QuotaExceeded when the tenant has ``max_active`` jobs not yet ended, or holds
        ``max_lines`` lines already (0: no bound)."""
        active, lines = self.held(tenant, now)
        if max_active and active >= max_active:
            raise QuotaExceeded(f"tenant {tenant!r} has {active} batches not yet ended: its bound is {max_active} "
                                "(LLMB_JOBS_TENANT_MAX_ACTIVE); wait for one to end, or cancel one")
        if max_lines and lines >= max_lines:
            raise QuotaExceeded(f"tenant {tenant!r} holds {lines} batch lines: its bound is {max_lines} "
                                "(LLMB_JOBS_TENANT_MAX_LINES); wait for its batches to end")
        record = BatchJobRecord(
            id=new_id("batch_", now), tenant=tenant, endpoint=endpoint, input_file_id=input_file_id,
            completion_window=completion_window, status="validating",
            meta=json.dumps(metadata) if metadata is not None else None, total=0, completed=0, failed=0,
            created_at=now, expires_at=now + COMPLETION_WINDOWS[completion_window],
            output_expires_s=output_expires_s)
        with Session(self.engine) as session, session.begin():
            session.add(record)
            session.flush()
            return _job(record)

    def held(self, tenant: str, now: float, *, besides: str | None = None) -> tuple[int, int]:
        """(jobs not yet ended, lines held) of ``tenant`` (leaving ``besides`` out): the lines of its jobs not yet
        ended and of its completed jobs not yet expired, by their ``total`` (no line is counted one by one)."""
        j = BatchJobRecord
        holding = or_(j.status.in_(ACTIVE), and_(j.status == "completed", j.expires_at > now))
        query = (select(func.count().filter(j.status.in_(ACTIVE)), func.coalesce(func.sum(j.total), 0))
                 .where(j.tenant == tenant, holding))
        if besides is not None:
            query = query.where(j.id != besides)
        with Session(self.engine) as session:
            active, lines = session.execute(query).one()
        return int(active or 0), int(lines or 0)

    def get(self, job_id: str, tenant: str | None = None) -> JobInfo | None:
        """The job, if it is ``tenant``'s (None: anyone's)."""
        with Session(self.engine) as session:
            r = session.get(BatchJobRecord, job_id)
            return _job(r) if r is not None and tenant in (None, r.tenant) else None

    def page(self, tenant: str | None = None, *, limit: int = 20, after: str | None = None,
             status: str | None = None) -> tuple[list[JobInfo], bool]:
        """A page of jobs, newest first, and whether more follow."""
        j = BatchJobRecord
        query = select(j).order_by(j.id.desc()).limit(limit + 1)
        if tenant is not None:
            query = query.where(j.tenant == tenant)
        if status is not None:
            query = query.where(j.status == status)
        if after:
            query = query.where(j.id < after)
        with Session(self.engine) as session:
            rows = [_job(r) for r in session.scalars(query)]
        return rows[:limit], len(rows) > limit

    def cancel(self, job_id: str, tenant: str | None, now: float) -> JobInfo | None:
        """Ask for the job to stop: ``cancelling`` (the process running it stops sending lines, lets the running
        ones finish, then marks it ``cancelled``). A job already stopping or stopped is left as it is."""
        j = BatchJobRecord
        condition = [j.id == job_id, j.status.in_(CANCELLABLE)]
        if tenant is not None:
            condition.append(j.tenant == tenant)
        with self.engine.begin() as conn:
            conn.execute(update(j).where(*condition).values(status="cancelling", cancelling_at=now))
        return self.get(job_id, tenant)

    # -- the feeder's side: leases ------------------------------------------------------------------------
    def claimable(self, now: float, limit: int) -> list[str]:
        """Jobs that need running and that no live process holds, oldest first."""
        j = BatchJobRecord
        query = (select(j.id).where(j.status.in_(ACTIVE), or_(j.lease_until.is_(None), j.lease_until < now))
                 .order_by(j.id).limit(limit))
        with Session(self.engine) as session:
            return list(session.scalars(query))

    def waiting(self, now: float, per_tenant: int) -> list[tuple[str, str]]:
        """(id, tenant) of the jobs that need running and that no live process holds: each tenant's
        ``per_tenant`` oldest, oldest first (what :func:`tasks.policy.feeding.pick_jobs` chooses from; a tenant
        with thousands of jobs waiting does not push the others' out of the answer)."""
        j = BatchJobRecord
        rank = func.row_number().over(partition_by=j.tenant, order_by=j.id).label("rank")
        inner = (select(j.id, j.tenant, rank)
                 .where(j.status.in_(ACTIVE), or_(j.lease_until.is_(None), j.lease_until < now)).subquery())
        query = select(inner.c.id, inner.c.tenant).where(inner.c.rank <= per_tenant).order_by(inner.c.id)
        with Session(self.engine) as session:
            return [(job_id, tenant) for job_id, tenant in session.execute(query)]

    def running_by_tenant(self, now: float) -> dict[str, int]:
        """Jobs held under a live lease now, by tenant, whichever process holds them."""
        j = BatchJobRecord
        query = (select(j.tenant, func.count()).where(j.status.in_(ACTIVE), j.lease_until >= now)
                 .group_by(j.tenant))
        with Session(self.engine) as session:
            return {tenant: int(n) for tenant, n in session.execute(query)}

    def claim(self, job_id: str, owner: str, now: float, lease_s: float) -> bool:
        """Take the job's lease, if it is free (never held, lapsed, or ours already)."""
        j = BatchJobRecord
        free = or_(j.lease_owner.is_(None), j.lease_until.is_(None), j.lease_until < now, j.lease_owner == owner)
        with self.engine.begin() as conn:
            done = conn.execute(update(j).where(j.id == job_id, j.status.in_(ACTIVE), free)
                                .values(lease_owner=owner, lease_until=now + lease_s))
            return bool(done.rowcount == 1)

    def renew(self, owner: str, job_ids: Sequence[str], now: float, lease_s: float) -> set[str]:
        """Extend the leases ``owner`` still holds among ``job_ids``; returns those."""
        if not job_ids:
            return set()
        j = BatchJobRecord
        held = and_(j.id.in_(list(job_ids)), j.lease_owner == owner, j.lease_until >= now)
        with self.engine.begin() as conn:
            conn.execute(update(j).where(held).values(lease_until=now + lease_s))
            rows = conn.execute(select(j.id).where(j.id.in_(list(job_ids)), j.lease_owner == owner,
                                                   j.lease_until >= now))
            return {r[0] for r in rows}

    def release(self, job_id: str, owner: str) -> None:
        """Give the lease up now (a graceful stop), so another process may take the job at once."""
        j = BatchJobRecord
        with self.engine.begin() as conn:
            conn.execute(update(j).where(j.id == job_id, j.lease_owner == owner)
                         .values(lease_owner=None, lease_until=None))

    # -- the feeder's side: a job's progress -------------------------------------------------------------
    def start(self, job_id: str, owner: str, lines: Iterable[InputLine], now: float) -> int | None:
        """Write a validated job's lines and move it to ``in_progress``, in one transaction; returns the lines
        written (None, and nothing written, when ``owner`` no longer holds it or it is no longer validating).
        ``lines`` is consumed as it is written, a chunk at a time: an exception it raises undoes everything."""
        j, ln = BatchJobRecord, BatchLineRecord
        total = 0
        with self.engine.begin() as conn:
            moved = conn.execute(update(j).where(j.id == job_id, j.lease_owner == owner, j.status == "validating")
                                 .values(status="in_progress", in_progress_at=now))
            if moved.rowcount != 1:
                return None
            rows: list[dict[str, Any]] = []
            size = 0
            for x in lines:
                body = json.dumps(x.body)
                rows.append({"job_id": job_id, "line_no": x.line_no, "custom_id": x.custom_id,
                             "request_id": line_request_id(job_id, x.line_no), "body": body, "status": "pending",
                             "attempts": 0})
                size += len(body)
                if len(rows) >= INSERT_CHUNK or size >= INSERT_CHUNK_BYTES:
                    conn.execute(insert(ln), rows)
                    total, rows, size = total + len(rows), [], 0
            if rows:
                conn.execute(insert(ln), rows)
                total += len(rows)
            conn.execute(update(j).where(j.id == job_id).values(total=total))
        return total

    def fail(self, job_id: str, owner: str, errors: Sequence[LineError], now: float) -> bool:
        """A job whose input is invalid: ``failed``, with OpenAI's ``errors`` list (at most MAX_ERRORS and the
        count of the rest: it is in every listing of the tenant's batches)."""
        j = BatchJobRecord
        errors = list(errors[:MAX_ERRORS + 1])
        with self.engine.begin() as conn:
            done = conn.execute(update(j).where(j.id == job_id, j.lease_owner == owner, j.status == "validating")
                                .values(status="failed", failed_at=now, lease_owner=None, lease_until=None,
                                        errors=json.dumps([e.to_dict() for e in errors])))
            if done.rowcount != 1:
                return False
            conn.execute(delete(BatchLineRecord).where(BatchLineRecord.job_id == job_id))
            return True

    def status(self, job_id: str) -> str | None:
        with Session(self.engine) as session:
            return session.scalar(select(BatchJobRecord.status).where(BatchJobRecord.id == job_id))

    def pending(self, job_id: str, after_line_no: int, limit: int) -> list[Line]:
        """The next pending lines after ``after_line_no``, in order."""
        ln = BatchLineRecord
        query = (select(ln.line_no, ln.custom_id, ln.request_id, ln.body, ln.attempts)
                 .where(ln.job_id == job_id, ln.status == "pending", ln.line_no > after_line_no)
                 .order_by(ln.line_no).limit(limit))
        with Session(self.engine) as session:
            return [Line(job_id, n, c, r, b, a) for n, c, r, b, a in session.execute(query)]

    def count(self, job_id: str, status: str) -> int:
        ln = BatchLineRecord
        with Session(self.engine) as session:
            return int(session.scalar(select(func.count()).select_from(ln)
                                      .where(ln.job_id == job_id, ln.status == status)) or 0)

    def counts(self, job_id: str) -> dict[str, int]:
        """Lines by status."""
        ln = BatchLineRecord
        with Session(self.engine) as session:
            rows = session.execute(select(ln.status, func.count()).where(ln.job_id == job_id).group_by(ln.status))
            return {status: int(n) for status, n in rows}

    def record(self, job_id: str, outcomes: Sequence[LineOutcome], now: float) -> tuple[int, int]:
        """Commit finished lines, and the job's counters with them, in one transaction; a line already finished
        (by an earlier run) is left as it was. Returns the (completed, failed) lines this call finished."""
        ln, j = BatchLineRecord, BatchJobRecord
        ok = failed = 0
        with self.engine.begin() as conn:
            for o in outcomes:
                done = conn.execute(update(ln).where(ln.job_id == job_id, ln.line_no == o.line_no,
                                                     ln.status == "pending")
                                    .values(status="ok" if o.ok else "error", status_code=o.status_code,
                                            output=o.output, finished_at=now, attempts=o.attempts))
                if done.rowcount == 1:
                    ok, failed = ok + o.ok, failed + (not o.ok)
            if ok or failed:
                conn.execute(update(j).where(j.id == job_id)
                             .values(completed=j.completed + ok, failed=j.failed + failed))
        return ok, failed

    def finalizing(self, job_id: str, owner: str, now: float) -> bool:
        """Every line is finished: ``finalizing`` while the output files are written."""
        j = BatchJobRecord
        with self.engine.begin() as conn:
            done = conn.execute(update(j).where(j.id == job_id, j.lease_owner == owner, j.status == "in_progress")
                                .values(status="finalizing", finalizing_at=now))
            return bool(done.rowcount == 1)

    def finish(self, job_id: str, owner: str, status: str, output_file_id: str | None, error_file_id: str | None,
               now: float) -> bool:
        """The job's end (``completed``, ``cancelled`` or ``expired``) with its files; the lease is given up. The
        lines of a job cancelled or expired are deleted with it (its files hold them); a completed job's are kept
        until its expiry (:meth:`sweep_lines`)."""
        j = BatchJobRecord
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]
        with self.engine.begin() as conn:
            done = conn.execute(update(j).where(j.id == job_id, j.lease_owner == owner, j.status.in_(ACTIVE))
                                .values(status=status, output_file_id=output_file_id, error_file_id=error_file_id,
                                        lease_owner=None, lease_until=None, **{stamp: now}))
            if done.rowcount != 1:
                return False
            if status != "completed":
                conn.execute(delete(BatchLineRecord).where(BatchLineRecord.job_id == job_id))
            return True

    def sweep_lines(self, now: float, limit: int) -> int:
        """Delete at most ``limit`` lines of ended jobs that still have some (a completed job's past its expiry;
        any other's, left by a version that kept every line for ever); returns how many."""
        j, ln = BatchJobRecord, BatchLineRecord
        ended = or_(j.status.in_(("failed", "cancelled", "expired")),
                    and_(j.status == "completed", j.expires_at <= now))
        has_lines = select(ln.job_id).where(ln.job_id == j.id).exists()
        deleted = 0
        with Session(self.engine) as session:
            job_ids = list(session.scalars(select(j.id).where(ended, has_lines).order_by(j.id).limit(limit)))
        for job_id in job_ids:
            while deleted < limit:
                chunk = min(DELETE_CHUNK, limit - deleted)
                with self.engine.begin() as conn:
                    last = conn.execute(select(ln.line_no).where(ln.job_id == job_id).order_by(ln.line_no)
                                        .offset(chunk - 1).limit(1)).scalar()
                    bounded = [ln.job_id == job_id] + ([] if last is None else [ln.line_no <= last])
                    n = int(conn.execute(delete(ln).where(*bounded)).rowcount or 0)
                deleted += n
                if last is None:
                    break
        return deleted

    def lines(self, job_id: str, *, after_line_no: int = -1, limit: int = 1000
              ) -> list[tuple[int, str, str, str, str | None]]:
        """(line_no, custom_id, request_id, status, output) of the lines after ``after_line_no``, in order."""
        ln = BatchLineRecord
        query = (select(ln.line_no, ln.custom_id, ln.request_id, ln.status, ln.output)
                 .where(ln.job_id == job_id, ln.line_no > after_line_no).order_by(ln.line_no).limit(limit))
        with Session(self.engine) as session:
            return [(n, c, r, s, o) for n, c, r, s, o in session.execute(query)]

    def all_lines(self, job_id: str, chunk: int = 1000) -> Iterator[tuple[int, str, str, str, str | None]]:
        """Every line of the job, in order, read ``chunk`` at a time."""
        after = -1
        while True:
            rows = self.lines(job_id, after_line_no=after, limit=chunk)
            yield from rows
            if len(rows) < chunk:
                return
            after = rows[-1][0]
