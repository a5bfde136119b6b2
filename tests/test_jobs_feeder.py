"""The batch jobs' feeder in one process, on a real SQLite database and file store, with the line runner faked:
retries and when a line gives up, expiry, cancellation, the leases between two feeders, which tenant's job a free
slot takes (SQLite and PostgreSQL), validation's memory, and the clean-up of expired files."""
from __future__ import annotations

import io
import json
import os
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from harness.stack import wait_for
from tasks.config import Settings
from tasks.jobs.feeder import Feeder
from tasks.jobs.job_run import JobRun, LineResult
from tasks.policy.feeding import MAX_LINE_ATTEMPTS, FeedControl
from tasks.store.files import FileStore
from tasks.store.jobs import JobInfo, JobStore, Line
from tasks.store.models import Base, FileRecord, make_engine
from tests.fakes import FakeClock

SETTINGS = Settings.of(jobs_poll_s=0.02, jobs_lease_s=1.0, jobs_initial_in_flight=4, jobs_max_in_flight=50)


def fast_control(settings: Settings) -> FeedControl:
    return FeedControl(initial=settings.jobs.initial_in_flight, ceiling=settings.jobs.max_in_flight,
                       first_backoff_s=0.001, max_backoff_s=0.005)


@pytest.fixture
def stores(tmp_path: Path) -> tuple[JobStore, FileStore]:
    engine = make_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
    Base.metadata.create_all(engine)
    return JobStore(engine), FileStore(engine, tmp_path / "files")


def new_job(stores: tuple[JobStore, FileStore], n: int, tenant: str = "t") -> JobInfo:
    jobs, files = stores
    body = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/infer",
                               "body": {"input": f"in {i}"}}) + "\n" for i in range(n))
    f = files.save(tenant, "batch", "in.jsonl", io.BytesIO(body.encode()), 10**6)
    return jobs.create(tenant, "/v1/infer", f.id, "24h", None, time.time())


class Runner:
    """A fake line runner: answers by input, counting every call by line request id (the device's view)."""

    def __init__(self, answer: Any = None, delay_s: float = 0.0) -> None:
        self.calls: Counter[str] = Counter()
        self.answer = answer or (lambda line, n: LineResult(200, {"output": json.loads(line.body)["input"]}))
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def __call__(self, job: JobInfo, line: Line, generation: int) -> LineResult:
        with self.lock:
            self.calls[line.request_id] += 1
            n = self.calls[line.request_id]
        time.sleep(self.delay_s)
        return self.answer(line, n)


def feeder(stores: tuple[JobStore, FileStore], runner: Runner, **kw: Any) -> Feeder:
    return Feeder(stores[0], stores[1], runner, kw.pop("settings", SETTINGS), control=fast_control, **kw)


def run_until(f: Feeder, what: Any, timeout_s: float = 20) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=f.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(what, timeout_s, "the feeder")
    finally:
        stop.set()
        thread.join(10)


def files_of(stores: tuple[JobStore, FileStore], job: JobInfo) -> tuple[list[Any], list[Any]]:
    def read(file_id: str | None) -> list[Any]:
        return [json.loads(x) for x in stores[1].path(file_id).read_text().splitlines()] if file_id else []

    return read(job.output_file_id), read(job.error_file_id)


def test_refusals_are_retried_and_failing_lines_give_up_after_their_attempts(stores: tuple[JobStore, FileStore]
                                                                              ) -> None:
    def answer(line: Line, n: int) -> LineResult:
        if line.custom_id == "c3":
            return LineResult(504, {"error": "late"}, "deadline_exceeded")  # for ever: given up after 8 tries
        if line.custom_id == "c4":
            raise RuntimeError("a bug of ours")  # for ever: an internal error, 8 tries too
        if line.custom_id == "c5":
            return LineResult(422, {"error": "poison"}, "poison_input")  # final at once
        if n <= 3:  # refused three times, then admitted: refusals never give up
            return LineResult(429, {"error": "full"}, "queue_full", retry_after_s=0.001)
        return LineResult(200, {"output": json.loads(line.body)["input"]})

    runner = Runner(answer)
    job = new_job(stores, 40)
    run_until(feeder(stores, runner), lambda: stores[0].status(job.id) == "completed")
    done = stores[0].get(job.id)
    assert done is not None and (done.total, done.completed, done.failed) == (40, 37, 3)
    outputs, errors = files_of(stores, done)
    assert len(outputs) == 37 and {e["custom_id"]: e["response"]["status_code"] for e in errors} == {
        "c3": 504, "c4": 500, "c5": 422}
    calls = {rid.rsplit("-", 1)[1]: n for rid, n in runner.calls.items()}
    assert calls["3"] == calls["4"] == MAX_LINE_ATTEMPTS and calls["5"] == 1
    assert calls["0"] == 4 and [x["custom_id"] for x in outputs][:3] == ["c0", "c1", "c2"], "input order"
    assert done.lease_owner is None


def test_a_job_past_its_window_expires_with_its_unrun_lines_in_the_error_file(stores: tuple[JobStore, FileStore]
                                                                             ) -> None:
    job = new_job(stores, 30)
    with stores[0].engine.begin() as conn:
        from sqlalchemy import update

        from tasks.store.models import BatchJobRecord
        conn.execute(update(BatchJobRecord).where(BatchJobRecord.id == job.id).values(expires_at=time.time() + 0.3))
    run_until(feeder(stores, Runner(delay_s=0.05), settings=Settings.of(
        jobs_poll_s=0.02, jobs_lease_s=1.0, jobs_initial_in_flight=1, jobs_max_in_flight=1)),
        lambda: stores[0].status(job.id) == "expired")
    done = stores[0].get(job.id)
    assert done is not None and done.expired_at and 0 < done.completed < 30
    outputs, errors = files_of(stores, done)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and len(outputs) + len(errors) == 30


def test_cancel_lets_the_lines_in_flight_finish_and_sends_no_more(stores: tuple[JobStore, FileStore]) -> None:
    runner = Runner(delay_s=0.2)
    job = new_job(stores, 200)
    f = feeder(stores, runner)
    stop = threading.Event()
    thread = threading.Thread(target=f.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: sum(runner.calls.values()) >= 4, 10, "lines in flight")
        stores[0].cancel(job.id, "t", time.time())
        wait_for(lambda: stores[0].status(job.id) == "cancelled", 10, "cancelled")
    finally:
        stop.set()
        thread.join(10)
    done = stores[0].get(job.id)
    assert done is not None
    outputs, errors = files_of(stores, done)
    assert len(outputs) == sum(runner.calls.values()) == done.completed < 200, "every line sent finished"
    assert len(errors) == 200 - len(outputs) and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert stores[0].cancel(job.id, "someone-else", time.time()) is None, "another tenant's job is not found"


def test_two_feeders_never_run_one_job_and_a_lapsed_lease_is_taken_over(stores: tuple[JobStore, FileStore]) -> None:
    jobs = stores[0]
    job = new_job(stores, 5)
    now = time.time()
    assert jobs.claim(job.id, "a", now, 1.0) and not jobs.claim(job.id, "b", now, 1.0)
    assert jobs.renew("a", [job.id], now + 0.5, 1.0) == {job.id}
    assert jobs.claimable(now + 1.0, 10) == [] and not jobs.claim(job.id, "b", now + 1.0, 1.0)
    assert jobs.claimable(now + 1.6, 10) == [job.id], "a's lease lapsed 1 s after its last renewal"
    assert jobs.claim(job.id, "b", now + 1.6, 1.0) and jobs.renew("a", [job.id], now + 1.7, 1.0) == set()
    jobs.release(job.id, "b")
    runner = Runner()
    first, second = feeder(stores, runner, owner="first"), feeder(stores, runner, owner="second")
    stop = threading.Event()
    threads = [threading.Thread(target=f.run, args=(stop,), daemon=True) for f in (first, second)]
    more = [new_job(stores, 50) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: all(jobs.status(j.id) == "completed" for j in [job, *more]), 20, "every job")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert set(runner.calls.values()) == {1} and len(runner.calls) == 5 + 4 * 50, "every line ran once"


# -- a slot's next job, across processes: the tenant running fewest (real SQLite and PostgreSQL) ----------------
@pytest.fixture
def db_stores(database_url: str, tmp_path: Path) -> tuple[JobStore, FileStore]:
    engine = make_engine(database_url)
    Base.metadata.create_all(engine)
    return JobStore(engine), FileStore(engine, tmp_path / "files")


def test_a_free_slot_goes_to_the_tenant_running_fewest_jobs_in_any_process(db_stores: tuple[JobStore, FileStore]
                                                                            ) -> None:
    """Tenant a queued six jobs before b and c queued one each. The first feeder's two slots take a's oldest and
    b's (not a's two oldest); a second feeder, counting what the first runs from the database, takes c's
    (not a's next, older than it)."""
    jobs = db_stores[0]
    a_jobs = [new_job(db_stores, 5, tenant="a") for _ in range(6)]
    b_job = new_job(db_stores, 5, tenant="b")
    release = threading.Event()
    runner = Runner(lambda line, n: (release.wait(20), LineResult(200, {"output": "x"}))[1])
    settings = SETTINGS.but(jobs_max_active=2)
    first = feeder(db_stores, runner, settings=settings, owner="first")
    second = feeder(db_stores, runner, settings=SETTINGS.but(jobs_max_active=1), owner="second")
    stop = threading.Event()
    threads = [threading.Thread(target=first.run, args=(stop,), daemon=True)]
    threads[0].start()
    try:
        wait_for(lambda: len(first.runs) == 2, 10, "the first feeder's two slots taken")
        assert set(first.runs) == {a_jobs[0].id, b_job.id}
        c_job = new_job(db_stores, 5, tenant="c")
        threads.append(threading.Thread(target=second.run, args=(stop,), daemon=True))
        threads[1].start()
        wait_for(lambda: len(second.runs) == 1, 10, "the second feeder's slot taken")
        assert set(second.runs) == {c_job.id}
        assert jobs.running_by_tenant(time.time()) == {"a": 1, "b": 1, "c": 1}
    finally:
        release.set()
        stop.set()
        for t in threads:
            t.join(10)


def test_validation_memory_does_not_grow_with_the_file(stores: tuple[JobStore, FileStore]) -> None:
    """A job's file is checked, then its lines written, as it is read: the validation's peak (tracemalloc) stays a
    small part of a 6 MB, 15,000-line file (it held the parsed file whole, about ten times its size)."""
    jobs, files = stores
    text = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/infer",
                               "body": {"input": f"{i} " + "w" * 360}}) + "\n" for i in range(15_000))
    info = files.save("t", "batch", "big.jsonl", io.BytesIO(text.encode()), 10**8)
    job = jobs.create("t", "/v1/infer", info.id, "24h", None, time.time())
    f = feeder(stores, Runner())
    assert jobs.claim(job.id, f.owner, time.time(), 60)
    run = JobRun(f.context, job.id)
    tracemalloc.start()
    try:
        started = run._validate(job)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert started is not None and started.status == "in_progress" and started.total == 15_000
    assert jobs.count(job.id, "pending") == 15_000
    assert peak < len(text) / 2, f"validation peaked at {peak} bytes for a file of {len(text)}"


def test_llmb_jobs_deletes_expired_files_and_what_killed_uploads_left(tmp_path: Path) -> None:
    """With an injected clock: past its expiry a file is not found, and the feeder's periodic clean-up deletes its
    bytes and its row; a temporary file older than an hour (a write killed mid-way) goes too, a fresh one stays."""
    engine = make_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
    Base.metadata.create_all(engine)
    clock = FakeClock(start=time.time())
    files = FileStore(engine, tmp_path / "files", clock=clock, expire_s=3600)
    soon = files.save("t", "batch", "a.jsonl", io.BytesIO(b"{}\n"), 100)
    later = files.save("t", "batch", "b.jsonl", io.BytesIO(b"{}\n"), 100, expires_s=7200)
    assert soon.expires_at is not None and soon.expires_at.timestamp() == pytest.approx(clock.now + 3600, abs=1)
    stale, fresh = files.root / ".upload-stale", files.root / ".upload-fresh"
    stale.write_bytes(b"cut off")
    fresh.write_bytes(b"being written")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    clock.advance(3601)
    assert files.get("t", soon.id) is None and [x.id for x in files.page("t")[0]] == [later.id]
    assert files.path(soon.id).exists(), "not yet deleted: not found, though"
    f = Feeder(JobStore(engine), files, Runner(), SETTINGS.but(files_cleanup_s=7200), clock=clock)
    f.tick()
    assert not files.path(soon.id).exists() and not stale.exists()
    assert files.path(later.id).exists() and fresh.exists()
    with Session(engine) as session:
        assert session.get(FileRecord, soon.id) is None and session.get(FileRecord, later.id) is not None
    clock.advance(3600)  # b expired, but the last clean-up was an hour ago
    f.tick()
    assert files.get("t", later.id) is None and files.path(later.id).exists(), "LLMB_FILES_CLEANUP_S apart"
    clock.advance(3600)
    f.tick()
    assert not files.path(later.id).exists()
