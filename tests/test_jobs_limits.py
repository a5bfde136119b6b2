"""Batch jobs bounded per tenant, in one process on a real SQLite database and file store (the line runner faked):
jobs not yet ended and lines held per tenant (one tenant at its bound does not stop another), a job's lines
deleted with its end (a completed job's with its expiry, by the feeder's bounded sweep), a job that cannot be
validated (past its expiry, its bytes gone) failing with a reason instead of being taken up again every lease,
and a create-and-cancel loop leaving the lines and the database file flat."""
from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from harness.stack import wait_for
from tasks.config import Settings
from tasks.errors import QuotaExceeded
from tasks.jobs.feeder import Feeder
from tasks.jobs.job_run import LineResult
from tasks.policy.batchfile import LineError
from tasks.policy.feeding import FeedControl
from tasks.store.files import FileStore
from tasks.store.jobs import JobInfo, JobStore, Line
from tasks.store.models import Base, BatchJobRecord, BatchLineRecord, make_engine
from tests.fakes import FakeClock
from tests.test_jobs_feeder import run_until

DAY = 86_400.0

Stores = tuple[JobStore, FileStore]


def settings(**kw: object) -> Settings:
    return Settings.of(**{"jobs_poll_s": 0.02, "jobs_lease_s": 1.0, "jobs_initial_in_flight": 4,
                          "jobs_max_in_flight": 50, **kw})


def fast_control(s: Settings) -> FeedControl:
    return FeedControl(initial=s.jobs.initial_in_flight, ceiling=s.jobs.max_in_flight, first_backoff_s=0.001,
                       max_backoff_s=0.005)


@pytest.fixture
def stores(database_url: str, tmp_path: Path) -> Stores:
    """On SQLite and on PostgreSQL."""
    engine = make_engine(database_url)
    Base.metadata.create_all(engine)
    return JobStore(engine), FileStore(engine, tmp_path / "files")


@pytest.fixture
def sqlite_stores(tmp_path: Path) -> Stores:
    engine = make_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
    Base.metadata.create_all(engine)
    return JobStore(engine), FileStore(engine, tmp_path / "files")


def upload(stores: Stores, n: int, tenant: str = "t", size: int = 10) -> str:
    body = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/infer",
                               "body": {"input": f"in {i} " + "\"x\"" * size}}) + "\n" for i in range(n))
    return stores[1].save(tenant, "batch", "in.jsonl", io.BytesIO(body.encode()), 10**8).id


def new_job(stores: Stores, n: int, tenant: str = "t", now: float | None = None, **bounds: int) -> JobInfo:
    return stores[0].create(tenant, "/v1/infer", upload(stores, n, tenant), "24h", None,
                            time.time() if now is None else now, **bounds)


def answer(delay_s: float = 0.0) -> Callable[[JobInfo, Line, int], LineResult]:
    def run(job: JobInfo, line: Line, generation: int) -> LineResult:
        time.sleep(delay_s)
        return LineResult(200, {"output": "ok"})

    return run


def feeder(stores: Stores, s: Settings | None = None, clock: Callable[[], float] = time.time,
           delay_s: float = 0.0) -> Feeder:
    return Feeder(stores[0], stores[1], answer(delay_s), s or settings(), clock=clock, control=fast_control)


def lines_held(stores: Stores, job_id: str | None = None) -> int:
    ln = BatchLineRecord
    query = select(func.count()).select_from(ln)
    with Session(stores[0].engine) as session:
        return int(session.scalar(query if job_id is None else query.where(ln.job_id == job_id)) or 0)


def error_codes(job: JobInfo | None) -> list[str]:
    assert job is not None and job.errors is not None, job
    return [e["code"] for e in job.errors]


def test_a_tenant_at_its_bound_of_jobs_is_refused_and_another_tenant_is_not(stores: Stores) -> None:
    jobs = stores[0]
    first = [new_job(stores, 3, "t", max_active=2) for _ in range(2)]
    with pytest.raises(QuotaExceeded, match=r"2 batches not yet ended: its bound is 2 \(LLMB_JOBS_TENANT_MAX_AC"):
        new_job(stores, 3, "t", max_active=2)
    assert new_job(stores, 3, "u", max_active=2).status == "validating", "another tenant is not stopped"
    now = time.time()
    assert jobs.claim(first[0].id, "me", now, 30) and jobs.fail(first[0].id, "me", [LineError(0, "x", "x")], now)
    assert new_job(stores, 3, "t", max_active=2).status == "validating", "an ended job frees its place"
    assert jobs.held("t", now) == (2, 0)


def test_a_job_over_its_tenants_lines_fails_validation_and_others_run(stores: Stores) -> None:
    jobs = stores[0]
    s = settings(jobs_tenant_max_lines=50)
    big = new_job(stores, 60)
    done = new_job(stores, 30)
    other = new_job(stores, 40, "u")
    run_until(feeder(stores, s), lambda: {jobs.status(x.id) for x in (big, done, other)} == {"failed", "completed"})
    assert jobs.status(done.id) == jobs.status(other.id) == "completed"
    failed = jobs.get(big.id)
    assert error_codes(failed) == ["too_many_lines"] and failed is not None and failed.errors is not None
    assert "bound of 50 batch lines" in failed.errors[0]["message"]
    assert lines_held(stores, big.id) == 0
    # a completed job's lines are kept (and counted) until its expiry: 30 held, so 30 more is over 50
    again = new_job(stores, 30)
    run_until(feeder(stores, s), lambda: jobs.status(again.id) == "failed")
    assert error_codes(jobs.get(again.id)) == ["too_many_lines"]
    assert jobs.held("t", time.time()) == (0, 30) and lines_held(stores, done.id) == 30
    with pytest.raises(QuotaExceeded, match="holds 30 batch lines: its bound is 30"):
        new_job(stores, 1, max_lines=30)


def test_lines_are_deleted_when_their_job_ends_and_a_completed_jobs_with_its_expiry(stores: Stores) -> None:
    jobs = stores[0]
    clock = FakeClock(time.time())
    cancelled, completed = new_job(stores, 200, now=clock()), new_job(stores, 20, now=clock())
    f = feeder(stores, clock=clock, delay_s=0.05)
    stop = threading.Event()
    thread = threading.Thread(target=f.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: jobs.status(cancelled.id) == "in_progress", 10, "its lines written")
        assert lines_held(stores, cancelled.id) == 200
        jobs.cancel(cancelled.id, "t", clock())
        wait_for(lambda: {jobs.status(cancelled.id), jobs.status(completed.id)} == {"cancelled", "completed"}, 20,
                 "both ended")
    finally:
        stop.set()
        thread.join(10)
    assert lines_held(stores, cancelled.id) == 0, "a cancelled job's lines go with it (its error file holds them)"
    assert lines_held(stores, completed.id) == 20, "a completed job's lines stay for `jobs show --lines`"
    f.clean_up()
    assert lines_held(stores, completed.id) == 20
    clock.advance(DAY + 1)
    assert jobs.sweep_lines(clock(), 7) == 7, "a sweep's pass is bounded"
    f.clean_up()
    assert lines_held(stores) == 0


def test_the_sweep_deletes_lines_earlier_versions_kept_a_bounded_number_a_pass(stores: Stores) -> None:
    jobs = stores[0]
    job, running = new_job(stores, 1), new_job(stores, 1)
    with jobs.engine.begin() as conn:  # a job cancelled under a version that kept its lines
        conn.execute(update(BatchJobRecord).where(BatchJobRecord.id == job.id).values(status="cancelled"))
        conn.execute(insert(BatchLineRecord), [
            {"job_id": x, "line_no": i, "custom_id": f"c{i}", "request_id": f"{x}-{i}", "body": "{}",
             "status": "pending", "attempts": 0} for x in (job.id, running.id) for i in range(12_000)])
    now = time.time()
    assert jobs.sweep_lines(now, 10_000) == 10_000 and jobs.sweep_lines(now, 10_000) == 2_000
    assert jobs.sweep_lines(now, 10_000) == 0 and lines_held(stores) == 12_000, "a running job's lines are kept"


def test_a_job_past_its_expiry_while_validating_fails_saying_so(stores: Stores) -> None:
    clock = FakeClock(time.time())
    job = new_job(stores, 5, now=clock())
    clock.advance(DAY + 1)  # no process ran it in its whole window
    run_until(feeder(stores, clock=clock), lambda: stores[0].status(job.id) == "failed")
    assert error_codes(stores[0].get(job.id)) == ["batch_expired"]


def test_a_job_whose_input_bytes_are_gone_fails_instead_of_retrying_every_lease(stores: Stores) -> None:
    job = new_job(stores, 5)
    stores[1].path(job.input_file_id).unlink()  # the row stays (a crash between deleting bytes and row)
    run_until(feeder(stores), lambda: stores[0].status(job.id) == "failed", timeout_s=5)
    failed = stores[0].get(job.id)
    assert error_codes(failed) == ["invalid_file"] and failed is not None and failed.errors is not None
    assert "is missing" in failed.errors[0]["message"]


def test_a_create_and_cancel_loop_leaves_the_lines_and_the_database_flat(sqlite_stores: Stores,
                                                                         tmp_path: Path) -> None:
    stores = sqlite_stores
    jobs = stores[0]
    file_id = upload(stores, 2_000, size=100)  # about 1 MB, 2.6 MB of escaped JSON in batch_lines
    f = feeder(stores, delay_s=0.2)
    stop = threading.Event()
    thread = threading.Thread(target=f.run, args=(stop,), daemon=True)
    thread.start()
    sizes, held = [], []
    try:
        for _ in range(10):
            job = jobs.create("t", "/v1/infer", file_id, "24h", None, time.time())
            wait_for(lambda: jobs.status(job.id) == "in_progress", 20, "its lines written")  # noqa: B023
            jobs.cancel(job.id, "t", time.time())
            wait_for(lambda: jobs.status(job.id) == "cancelled", 20, "cancelled")  # noqa: B023
            sizes.append(sum(p.stat().st_size for p in tmp_path.glob("jobs.db*")))  # the file and its WAL
            held.append(lines_held(stores))
    finally:
        stop.set()
        thread.join(10)
    print(f"\nSQLite file after each of 10 create-and-cancel rounds of a 2,000-line job: {sizes}")
    assert held == [0] * 10
    assert sizes[-1] <= sizes[1] * 1.05, sizes


def test_a_tenant_over_its_files_quota_gets_no_new_batch_and_another_does(stores: Stores, tmp_path: Path) -> None:
    """A batch's output and error files count against its tenant's files quota: at the quota, no new batch (a
    create-and-cancel loop adds an error file each round)."""
    files = FileStore(stores[0].engine, tmp_path / "files", tenant_max_count=2, tenant_max_bytes=10_000)
    for _ in range(2):
        upload(stores, 1)  # (through a store without quota: as a job's output files are written)
    with pytest.raises(QuotaExceeded, match="LLMB_FILES_TENANT_MAX_COUNT"):
        files.check_quota("t")
    upload(stores, 60, "u", size=40)
    with pytest.raises(QuotaExceeded, match="its quota is 10000 bytes"):
        files.check_quota("u")
    files.check_quota("v")
