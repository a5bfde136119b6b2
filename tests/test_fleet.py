"""The fleet end to end: worker crashes and stalls, poison inputs, the ledger's record, speed-aware routing.

Three sim workers with 500 ms batches and a 1.5 s batch wait (so that 100 concurrent requests form exactly
one batch of 100), heartbeats every 250 ms (stale after 1 s), poison triggers on, inputs stored.
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.helpers import assert_json_error, decoded, expected, post
from harness.stack import Stack, running_stack, wait_for
from tasks.store.models import BatchRecord, QuarantineRecord, RequestRecord, make_engine
from tests.fakes import FakeClock

RAISE, KILL = "__raise_here__", "__kill_here__"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("fleet")), workers=(0, 1, 2), sim_batch_ms=500,
                       wait_mode="fixed", max_wait_ms=1500, heartbeat_interval_s=0.25, heartbeat_stale_factor=4,
                       sim_raise_on=RAISE, sim_kill_on=KILL, store_inputs="true") as s:
        yield s


def send(stack: Stack, texts: list[str], timeout_ms: int = 120_000) -> list[Future[requests.Response]]:
    pool = ThreadPoolExecutor(max_workers=len(texts))
    futures = [pool.submit(post, stack.url, {"input": t, "timeout_ms": timeout_ms}, timeout=180) for t in texts]
    pool.shutdown(wait=False)
    return futures


def busy_worker(stack: Stack, timeout_s: float = 30) -> int:
    """The device number of a worker that is running a batch right now: one holding a batch's claim (a run id,
    ``<worker id>/<token>``; a settled claim starts with ``~``), set as the batch starts. A heartbeat says
    "busy" up to a beat late, and acting on it a loaded host could hit a worker whose batch had just ended,
    leaving nothing to recover."""
    found: list[int] = []

    def check() -> bool:
        owners = [stack.redis.get(key) for key in stack.redis.scan_iter(f"{stack.namespace}:claim:*")]
        found[:] = [int(decoded(o).split("@")[0][3:]) for o in owners if o and not decoded(o).startswith("~")]
        return bool(found)

    wait_for(check, timeout_s, "a busy worker")
    return found[0]


def ledger(stack: Stack) -> Session:
    return Session(make_engine(stack.database_url))


def restore_workers(stack: Stack) -> None:
    for n in range(3):
        if f"gpu{n}" not in stack.procs:
            stack.start_worker(n)
    stack.wait_ready(workers=3)
    wait_for(lambda: sum(1 for hb in stack.fleet().values() if time.time() - hb["heartbeat_at"] < 1) == 3,
             30, "three fresh heartbeats")


def test_sigkill_of_a_worker_mid_batch_loses_no_request(fleet: Stack) -> None:
    texts = [f"crash {uuid.uuid4().hex}" for _ in range(150)]
    futures = send(fleet, texts)
    victim = busy_worker(fleet)
    fleet.kill(f"gpu{victim}", sig=signal.SIGKILL)  # the supervisor and its worker, like a lost host
    try:
        for text, future in zip(texts, futures):
            r = future.result()
            assert r.status_code == 200, r.text
            assert r.json()["output"] == expected(text)
        with ledger(fleet) as s:
            lost = list(s.scalars(select(BatchRecord).where(BatchRecord.worker == f"gpu{victim}@test",
                                                            BatchRecord.status.in_(["died", "reassigned"]))))
        assert lost, "the ledger records what happened to the lost worker's batches"
    finally:  # the next tests need the whole fleet, whatever happened here
        restore_workers(fleet)


def test_a_worker_that_stops_heartbeating_is_removed_and_its_batches_go_elsewhere(fleet: Stack) -> None:
    texts = [f"stall {uuid.uuid4().hex}" for _ in range(150)]
    futures = send(fleet, texts)
    victim = busy_worker(fleet)
    pgid = fleet.procs[f"gpu{victim}"].pid
    os.killpg(pgid, signal.SIGSTOP)
    try:
        wait_for(lambda: f"gpu{victim}@test" not in fleet.fleet(), 10, "the silent worker to leave the pool")
        assert requests.get(fleet.url + "/readyz", timeout=5).json()["workers"] == 2
        for text, future in zip(texts, futures):
            r = future.result()
            assert r.status_code == 200, r.text
            assert r.json()["output"] == expected(text)
    finally:
        os.killpg(pgid, signal.SIGCONT)
    wait_for(lambda: f"gpu{victim}@test" in fleet.fleet(), 10, "the worker to come back after SIGCONT")
    restore_workers(fleet)


def _isolation(fleet: Stack, marker: str) -> tuple[str, str]:
    """100 requests in one batch, one of them poison; returns the poison text and its request's item id."""
    poison = f"{marker} {uuid.uuid4().hex}"
    texts = [f"healthy {uuid.uuid4().hex}" for _ in range(99)]
    texts.insert(37, poison)
    futures = send(fleet, texts)
    for text, future in zip(texts, futures):
        r = future.result()
        if text == poison:
            error = assert_json_error(r, 422, "poison_input")
            assert "quarantined" in error["message"]
        else:
            assert r.status_code == 200, r.text
            assert r.json()["output"] == expected(text)
    # the split tree: from a batch of 100 down to the poison input alone
    with ledger(fleet) as s:
        wait_for(lambda: s.scalars(select(RequestRecord).where(RequestRecord.input == poison,
                                                               RequestRecord.status == "poison")).first(),
                 10, "the poison request in the ledger")
        record = s.scalars(select(RequestRecord).where(RequestRecord.input == poison)).one()
        leaf = s.get(BatchRecord, record.batch_id)
        assert leaf is not None and leaf.size == 1 and leaf.status in ("raised", "died")
        chain = [leaf]
        while chain[-1].parent_id:
            parent = s.get(BatchRecord, chain[-1].parent_id)
            assert parent is not None and parent.status in ("raised", "died")
            chain.append(parent)
        assert chain[-1].size == 100 and chain[-1].attempt == 0
        assert [b.size for b in reversed(chain)] == sorted((b.size for b in chain), reverse=True)
        assert s.get(QuarantineRecord, record.input_hash) is not None
    return poison, record.input_hash


def test_a_raising_input_fails_alone_and_is_quarantined(fleet: Stack) -> None:
    poison, digest = _isolation(fleet, RAISE)
    before = fleet.items_done()
    started = time.monotonic()
    r = post(fleet.url, {"input": poison})
    assert_json_error(r, 422, "poison_input")
    assert time.monotonic() - started < 1.0, "a quarantined input is refused at the door"
    assert fleet.items_done() == before
    listing = fleet.admin("quarantine", "list", "--json")
    assert digest in [e["hash"] for e in json.loads(listing.stdout)]
    fleet.admin("quarantine", "release", digest)
    assert digest not in fleet.admin("quarantine", "list").stdout
    released = fleet.admin("quarantine", "release", digest, check=False)
    assert released.returncode == 1 and "not quarantined" in released.stderr


def test_an_input_that_kills_its_worker_fails_alone_and_the_workers_come_back(fleet: Stack) -> None:
    poison, _ = _isolation(fleet, KILL)
    assert_json_error(post(fleet.url, {"input": poison}), 422, "poison_input")
    restore_workers(fleet)  # the supervisors restarted every worker the poison killed


def test_admin_cli_against_the_running_system(fleet: Stack) -> None:
    texts = [f"cli {uuid.uuid4().hex}" for _ in range(5)]
    for future in send(fleet, texts):
        assert future.result().status_code == 200
    workers = fleet.admin("workers")
    assert all(f"gpu{n}@test" in workers.stdout for n in range(3))
    assert len(json.loads(fleet.admin("workers", "--json").stdout)) == 3
    stats = json.loads(fleet.admin("stats", "--interval", "0.2", "--json").stdout)
    assert stats["live_workers"] == 3 and stats["queue_depth"] == 0 and stats["in_flight"] == 0
    with ledger(fleet) as s:
        wait_for(lambda: s.scalars(select(RequestRecord).where(RequestRecord.input == texts[0])).first(), 10,
                 "the request in the ledger")
        record = s.scalars(select(RequestRecord).where(RequestRecord.input == texts[0])).one()
    again = fleet.admin("requeue", record.id)
    assert record.id in again.stdout and json.dumps(expected(texts[0])) in again.stdout
    assert record.batch_id is not None
    again = fleet.admin("requeue", record.batch_id)  # a whole batch
    assert json.dumps(expected(texts[0])) in again.stdout
    dry = fleet.admin("replay", "--status", "ok", "--tenant", "default", "--limit", "3", "--dry-run")
    assert "would replay 3 request(s)" in dry.stdout
    done = fleet.admin("replay", "--status", "ok", "--limit", "3")
    assert "replayed 3 ok" in done.stdout
    bad = fleet.admin("replay", "--since", "yesterday-ish", check=False)
    assert bad.returncode == 2 and "ISO time" in bad.stderr
    missing = fleet.admin("requeue", "no-such-id", check=False)
    assert missing.returncode == 1 and "no batch or request" in missing.stderr


def test_a_worker_twice_as_slow_gets_about_half_the_batches(tmp_path: Path) -> None:
    with running_stack(tmp_path, workers=[(0, {"sim_batch_ms": 200}), (1, {"sim_batch_ms": 400})], web_workers=1,
                       heartbeat_interval_s=0.25) as s:
        deadline = time.monotonic() + 8
        texts = [f"load {k}" for k in range(100)]

        def load() -> None:
            while time.monotonic() < deadline:
                r = post(s.url, {"inputs": texts, "timeout_ms": 60_000}, timeout=120)
                assert r.status_code == 200, r.text

        with ThreadPoolExecutor(max_workers=12) as pool:
            for f in [pool.submit(load) for _ in range(12)]:
                f.result()
        done = {w: hb["completed"] for w, hb in s.fleet().items()}
        fast, slow = done["gpu0@test"], done["gpu1@test"]
        assert fast > 10 and 0.35 <= slow / fast <= 0.65, done


def test_a_stopping_worker_hands_back_its_prefetched_batch_and_finishes_the_running_one(tmp_path: Path) -> None:
    """SIGTERM (a scale-down, a rollout): the running batch finishes there, the one waiting in its queue goes
    to the other worker, nobody is blamed and nobody waits past the batch times."""
    with running_stack(tmp_path, workers=[(0, {"sim_batch_ms": 8000})],  # long enough for gpu1 to start while it runs
                       web_workers=1, sim_batch_ms=1500, heartbeat_interval_s=0.25, heartbeat_stale_factor=4,
                       dispatch_lead_ms=60_000, wait_mode="fixed", max_wait_ms=50) as s:
        first = send(s, [f"first {uuid.uuid4().hex}" for _ in range(1)])
        wait_for(lambda: s.fleet()["gpu0@test"]["state"] == "busy", 20, "the first batch to start")
        texts = [f"second {uuid.uuid4().hex}" for _ in range(5)]
        second = send(s, texts)  # the lead lets this batch go to gpu0's queue at once, behind the running one
        wait_for(lambda: s.fleet()["gpu0@test"]["outstanding"] == 2, 20, "a batch waiting in gpu0's queue")
        s.start_worker(1)
        s.wait_ready(workers=2)
        s.kill("gpu0", signal.SIGTERM)
        assert "Warm shutdown" in s.log("gpu0") and first[0].result().status_code == 200
        for text, future in zip(texts, second):
            r = future.result()
            assert r.status_code == 200, r.text
            assert r.json()["output"] == expected(text)
        assert "handing it back unstarted" in s.log("gpu0") or "handed back" in s.log("gpu0")
        assert not json.loads(s.admin("quarantine", "list", "--json").stdout)


def test_a_workers_busy_fraction_counts_batches_running_at_once_once() -> None:
    """Continuous batching runs several batches at once: the device is busy while any runs, not their sum."""
    from gpu_worker.worker_state import WorkerState

    state = WorkerState(window_s=60.0, clock=FakeClock(start=0.0))
    state.add_work(10.0, 100, now=10.0)  # ran 0..10
    state.add_work(5.0, 100, now=10.0)   # ran 5..10, beside it
    state.add_work(4.0, 100, now=30.0)   # ran 26..30
    tokens_per_s, busy = state.rates(now=60.0)
    assert busy == pytest.approx(14 / 60)
    assert tokens_per_s == pytest.approx(300 / 60)
