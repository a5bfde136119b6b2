"""The batch runner's use of the device: one batch at a time on it, the host work of one batch overlapping the
next batch's run (real Redis for the claims and results; the backend, announcements and ledger recorded)."""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from gpu_worker.backends.interface import Hooks
from gpu_worker.device_slots import Device as Slots
from gpu_worker.runner import BatchRunner
from gpu_worker.worker_state import WorkerState, measure_full_batch
from harness.stack import REDIS_URL
from tasks.schema import Batch, BatchItem, SamplingParams
from tasks.state.claims import Claims
from tasks.state.results import ResultWriter
from tests.fakes import FakeClock


class Device:
    """A backend that records when each batch ran, and whether two ever ran at once."""

    name = "sim"
    kind = "sim"
    max_batch = 100
    max_context = 0
    slots = 1

    def __init__(self) -> None:
        self.runs: list[tuple[str, float, float]] = []
        self.running = 0
        self.overlapped = False

    def run(self, inputs: Sequence[str], params: Sequence[SamplingParams] | None = None,
            hooks: Hooks | None = None) -> list[str]:
        self.running += 1
        self.overlapped |= self.running > 1
        started = time.monotonic()
        time.sleep(0.05)
        self.running -= 1
        self.runs.append((inputs[0], started, time.monotonic()))
        return [f"out:{text}" for text in inputs]


class SlowWriter(ResultWriter):
    """Writes results only once the test lets the first batch's write go."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_may_write = threading.Event()
        self.writing_first = threading.Event()

    def write(self, results: Any, done_key: str | None = None, extra: Any = None) -> None:
        results = list(results)
        if results and results[0][0].input == "first":
            self.writing_first.set()
            assert self.first_may_write.wait(5)
        super().write(results, done_key, extra)


@pytest.fixture
def prefix() -> Iterator[str]:
    client = redis.Redis.from_url(REDIS_URL)
    name = f"run{uuid.uuid4().hex[:8]}"
    yield name
    for key in client.scan_iter(f"{name}:*"):
        client.delete(key)


def batch(text: str) -> Batch:
    deadline = time.time() + 30
    return Batch(id=uuid.uuid4().hex, model="sim", created_at=time.time(), items=(
        BatchItem(id=uuid.uuid4().hex, request_id=text, input=text, deadline=deadline, accepted_at=time.time(),
                  reply_to=f"replies.{text}"),))


def test_the_next_batch_runs_while_the_last_ones_results_are_written_never_two_on_the_device(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    device = Device()
    writer = SlowWriter(client, lambda item_id: f"{prefix}:result:{item_id}", 60)
    events: list[tuple[str, str]] = []
    runner = BatchRunner(device, writer, "gpu0@test", WorkerState(), announce=lambda e: events.append(
        (e.event, e.batch_id)), claims=Claims(client, f"{prefix}:claims"), give_back=lambda *a: None,
        record=lambda event: None)
    first, second = batch("first"), batch("second")
    with ThreadPoolExecutor(max_workers=2) as pool:  # the worker's pool: the device's slot and a host thread
        ran_first = pool.submit(runner.run, first)
        assert writer.writing_first.wait(5)
        ran_second = pool.submit(runner.run, second)
        summary = ran_second.result(timeout=5)  # the first batch is still writing its results
        assert summary.get("run_ms") and not ran_first.done()
        writer.first_may_write.set()
        assert ran_first.result(timeout=5).get("run_ms")
        together = [pool.submit(runner.run, batch(text)) for text in ("third", "fourth")]  # due at the same time
        assert all(f.result(timeout=5).get("run_ms") for f in together)
    assert [r[0] for r in device.runs][:2] == ["first", "second"] and len(device.runs) == 4
    assert not device.overlapped, "two batches were on the device at once"
    for b in (first, second):
        assert client.get(f"{prefix}:result:{b.items[0].id}") is not None
        assert ("started", b.id) in events and ("finished", b.id) in events


def test_a_batch_that_finds_the_device_free_says_how_long_it_sat_idle(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    events: list[Any] = []
    runner = BatchRunner(Device(), ResultWriter(client, lambda item_id: f"{prefix}:result:{item_id}", 60),
                         "gpu0@test", WorkerState(), announce=events.append,
                         claims=Claims(client, f"{prefix}:claims"), give_back=lambda *a: None,
                         record=lambda event: None)
    runner.run(batch("first"))
    time.sleep(0.1)  # nothing for the device meanwhile: the next batch came (at least) 100 ms late
    runner.run(batch("second"))
    started = [e for e in events if e.event == "started"]
    assert len(started) == 2 and started[1].idle_ms >= 100 and started[1].at is not None
    assert all(e.idle_ms is None for e in events if e.event == "finished")


def test_the_device_is_idle_only_while_a_slot_is_free() -> None:
    clock = FakeClock(start=10.0)
    one = Slots(1, clock=clock)
    one.acquire()
    clock.now = 11.0
    assert one.idle_s() == 0.0  # a batch arriving now waits for the device: on time
    one.release()
    clock.now = 11.25
    assert one.idle_s() == 0.25  # free since its release, not since it was made
    assert Slots(2).idle_s() is None  # with several slots a free one is no news


class Warm:
    """A backend whose batch takes 50 ms; ``fails`` makes its warm-up raise."""

    max_batch = 8

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.sizes: list[int] = []

    def run(self, inputs: Sequence[str], params: Any = None, hooks: Any = None) -> list[str]:
        self.sizes.append(len(inputs))
        if self.fails:
            raise RuntimeError("no device")
        time.sleep(0.05)
        return list(inputs)


def test_a_worker_measures_one_full_batch_before_serving() -> None:
    """Admission sizes its deadline cap from the batch time a worker reports; one that had measured nothing
    left the cap at its maximum, and a burst into a new fleet was admitted whole to time out."""
    backend, state = Warm(), WorkerState()
    measure_full_batch(backend, state)  # type: ignore[arg-type]
    assert backend.sizes == [8]  # a full batch
    assert 50 <= state.batch_ms_estimate < 5000 and state.completed == 0  # an estimate, not a batch served


def test_a_failed_warm_up_leaves_the_estimate_unmeasured() -> None:
    backend, state = Warm(fails=True), WorkerState()
    measure_full_batch(backend, state)  # type: ignore[arg-type]
    assert state.batch_ms_estimate == 0.0
