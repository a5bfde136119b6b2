"""A planned restart of a model's only worker is not a dead model (issue 45): a worker stopped gracefully is
awaited back for ``LLMB_RESTART_HOLD_S``, and the API's view of the fleet keeps its model served meanwhile, so its
calls are admitted and wait for the replacement instead of a 404 or 503. Batchers never see it."""
from __future__ import annotations

import threading
import uuid
from dataclasses import replace
from typing import cast

from harness.stack import REDIS_URL
from tasks.schema import DRAINING, STARTING, WorkerInfo
from tasks.state.connect import redis_client
from tasks.state.fleet import Fleet, FleetCache, live_of, returning_of
from tests.fakes import FakeClock


def worker(wid: str, model: str, at: float = 0.0, state: str = "idle") -> WorkerInfo:
    return WorkerInfo(id=wid, queue=f"q.{wid}", model=model, max_batch=8, state=state, outstanding=0, completed=0,
                      batch_started_at=None, batch_ms_estimate=50.0, heartbeat_at=at)


def test_a_worker_awaited_back_serves_its_model_only_while_no_other_does_and_its_hold_lasts() -> None:
    lm = worker("gpu2@h", "sim-lm", state=DRAINING)
    live = [worker("gpu0@h", "sim")]
    assert returning_of(live, [(60.0, lm)], now=10.0) == [lm]
    assert returning_of(live, [(60.0, replace(lm, state="idle"))], now=10.0)[0].state == DRAINING
    assert returning_of(live, [(60.0, lm)], now=61.0) == [], "past its hold: the model is no longer served"
    assert returning_of([*live, worker("gpu4@h", "sim-lm")], [(60.0, lm)], now=10.0) == [], "another serves it"
    assert returning_of([*live, worker("gpu2@h", "sim-lm")], [(60.0, lm)], now=10.0) == [], "it is back"


def test_a_starting_worker_serves_its_model_for_the_api_and_gets_no_batch() -> None:
    """A worker beats from the start of its pool, before its consumer consumes. A batch sent to it meanwhile waited
    in its queue, and a batcher's check could judge it lost ("nobody consumes"), taking its heartbeat out of the
    view. Starting, it is no batcher's to route to; the API counts it as serving its model (its hold has ended)."""
    starting = worker("gpu2@h", "sim-lm", at=10.0, state=STARTING)
    assert live_of([starting], 10.0, 3.0, draining=False) == []
    assert live_of([starting], 10.0, 3.0, draining=True) == [starting]
    assert live_of([replace(starting, state="idle")], 10.0, 3.0, draining=False) != []


def test_a_worker_beats_starting_until_its_consumer_consumes_then_draining_once_stopped() -> None:
    from gpu_worker.heartbeat import WorkerRuntime
    from gpu_worker.worker_state import WorkerState
    from tasks.config import Settings

    runtime = WorkerRuntime("gpu2@h", "q.gpu2", "sim-lm", 8, cast(Fleet, Hash()), WorkerState(clock=lambda: 5.0),
                            Settings.from_env())
    assert runtime.info().state == STARTING
    runtime.ready()  # Celery's worker_ready: sent right after the consumer's basic.consume
    assert runtime.info().state == "idle"
    runtime.begin_drain()
    assert runtime.info().state == DRAINING


class Hash:
    """The fleet hash and the workers awaited back, as Redis holds them, read by a FleetCache."""

    def __init__(self) -> None:
        self.stale_after_s = 3.0
        self.workers = [worker("gpu0@h", "sim")]
        self.back: list[tuple[float, WorkerInfo]] = [(60.0, worker("gpu2@h", "sim-lm", state=DRAINING))]
        self.during: dict[int, object] = {}  # what runs while the n-th read waits for Redis
        self.reads = 0

    def _read(self) -> None:
        self.reads += 1
        another = self.during.pop(self.reads, None)
        if another is not None:
            another()  # type: ignore[operator]

    def all(self) -> list[WorkerInfo]:
        self._read()
        return list(self.workers)

    def read(self) -> tuple[list[WorkerInfo], list[tuple[float, WorkerInfo]]]:
        self._read()
        return list(self.workers), list(self.back)


def test_the_apis_view_keeps_a_restarting_models_worker_and_the_batchers_does_not() -> None:
    clock, fleet = FakeClock(start=0.0), Hash()
    api = FleetCache(cast(Fleet, fleet), 0.5, draining=True, clock=clock, wallclock=clock)
    batcher = FleetCache(cast(Fleet, fleet), 0.5, clock=clock, wallclock=clock)
    assert {w.model for w in api.get()} == {"sim", "sim-lm"} and api.knows("sim-lm", 1.0)
    assert {w.model for w in batcher.get()} == {"sim"}


def test_a_reader_let_in_while_the_view_is_read_never_sees_it_without_the_worker_awaited_back() -> None:
    """API processes are gevent: reading Redis lets other calls in. One that came in while the view was half
    built took a view without the restarting model's worker and answered 404 (3 calls of 3,800 in a rollout)."""
    clock, fleet = FakeClock(start=0.0), Hash()
    cache = FleetCache(cast(Fleet, fleet), 0.5, draining=True, clock=clock, wallclock=clock)
    seen: list[set[str]] = []
    # a first caller reads the fleet; while it waits, a second reads it all, and while that one waits a third
    # takes the view as it stands
    fleet.during[1] = lambda: cache.get(fresh=True)
    fleet.during[2] = lambda: seen.append({w.model for w in cache.get()})
    cache.get(fresh=True)
    assert seen == [{"sim", "sim-lm"}]
    assert {w.model for w in cache.get()} == {"sim", "sim-lm"}


def test_the_fleet_and_the_workers_awaited_back_are_read_as_of_one_instant() -> None:
    """The heartbeats and the holds were two reads: a replacement that beat and ended its hold between them was in
    neither, and the API processes answered its model's calls 404 ("not served here") for half a second (4 and 38
    calls of two CI rollouts). Real Redis: a thread restarts the model's only worker over and over (depart with a
    hold; beat; end the hold) while the view is read; every read holds the model."""
    client, key = redis_client(REDIS_URL), f"rh{uuid.uuid4().hex[:10]}:fleet"
    fleet, writer = Fleet(client, key, 60.0), Fleet(redis_client(REDIS_URL), key, 60.0)
    lm = worker("gpu2@h", "sim-lm", at=1000.0)
    writer.beat(lm)
    stop, restarts = threading.Event(), [0]

    def restart() -> None:
        while not stop.is_set():
            writer.depart(lm, hold_s=60.0)
            writer.beat(lm)
            writer.back(lm.id)
            restarts[0] += 1

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    try:
        missing = 0
        for _ in range(3000):
            beats, awaited = fleet.read()
            missing += "sim-lm" not in {w.model for w in beats} | {w.model for _, w in awaited}
        assert restarts[0] > 50, "the restarts ran alongside the reads"
        assert missing == 0
    finally:
        stop.set()
        thread.join(timeout=5)
        client.delete(key, f"{key}:returning")
        client.close()


def test_a_lost_workers_heartbeat_is_removed_only_if_no_newer_one_replaced_it() -> None:
    """A batcher judges a worker lost from one read of the fleet, then takes its batches back and removes its
    heartbeat. A process restarted under the same id that beat meanwhile stays in the view."""
    client, key = redis_client(REDIS_URL), f"rh{uuid.uuid4().hex[:10]}:fleet"
    fleet = Fleet(client, key, 3.0)
    try:
        fleet.beat(worker("gpu2@h", "sim-lm", at=1000.25))
        assert not fleet.leave("gpu2@h", seen_at=1000.0), "a newer heartbeat than the one judged"
        assert [w.id for w in fleet.all()] == ["gpu2@h"]
        assert fleet.leave("gpu2@h", seen_at=1000.25), "the heartbeat judged lost"
        assert fleet.all() == []
        assert not fleet.leave("gpu2@h", seen_at=1000.25), "already gone"
        client.hset(key, "gpu9@old", "not json")  # another version's entry, judged by its absence of a time
        assert fleet.leave("gpu9@old", seen_at=1000.0)
    finally:
        client.delete(key)
        client.close()


def test_each_stop_prunes_the_holds_that_ended_so_the_table_is_bounded() -> None:
    """Pods get new names on every rollout, so worker ids never come back: a hold that ended must not stay."""
    client, key = redis_client(REDIS_URL), f"rh{uuid.uuid4().hex[:10]}:fleet"
    fleet = Fleet(client, key, 6.0)
    try:
        for i in range(50):  # fifty pods, each stopped once, 10 s apart, each held 60 s
            fleet.depart(worker(f"gpu0@pod-{i}", "sim-lm", at=1000.0 + 10 * i), hold_s=60.0)
        assert client.hlen(f"{key}:returning") <= 7, "only the holds still running are kept"
        client.hset(f"{key}:returning", "gpu0@old", "not json")  # another version's entry
        fleet.depart(worker("gpu0@pod-last", "sim-lm", at=5000.0), hold_s=60.0)
        assert set(client.hkeys(f"{key}:returning")) == {b"gpu0@pod-last"}
        assert [w.id for _, w in fleet.read()[1]] == ["gpu0@pod-last"]
    finally:
        client.delete(key, f"{key}:returning")
        client.close()
