"""A planned restart of a model's only worker is not a dead model (issue 45): a worker stopped gracefully is
awaited back for ``LLMB_RESTART_HOLD_S``, and the API's view of the fleet keeps its model served meanwhile, so its
calls are admitted and wait for the replacement instead of a 404 or 503. Batchers never see it."""
from __future__ import annotations

import uuid
from dataclasses import replace
from typing import cast

from harness.stack import REDIS_URL
from tasks.schema import DRAINING, WorkerInfo
from tasks.state.connect import redis_client
from tasks.state.fleet import Fleet, FleetCache, returning_of
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


class Hash:
    """The fleet hash and the workers awaited back, as Redis holds them, read by a FleetCache."""

    def __init__(self) -> None:
        self.stale_after_s = 3.0
        self.workers = [worker("gpu0@h", "sim")]
        self.back: list[tuple[float, WorkerInfo]] = [(60.0, worker("gpu2@h", "sim-lm", state=DRAINING))]
        self.during_all: dict[int, object] = {}  # what runs while the n-th read of the hash waits for Redis
        self.during_returning: dict[int, object] = {}  # ... and the n-th read of the workers awaited back
        self.reads = {"all": 0, "returning": 0}

    def _read(self, what: str, during: dict[int, object]) -> None:
        self.reads[what] += 1
        another = during.pop(self.reads[what], None)
        if another is not None:
            another()  # type: ignore[operator]

    def all(self) -> list[WorkerInfo]:
        self._read("all", self.during_all)
        return list(self.workers)

    def returning(self) -> list[tuple[float, WorkerInfo]]:
        self._read("returning", self.during_returning)
        return list(self.back)


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
    # a first caller reads the hash; while it waits, a second reads it all; while the first then waits for the
    # workers awaited back, a third takes the (fresh by then) view
    fleet.during_all[1] = lambda: cache.get(fresh=True)
    fleet.during_returning[2] = lambda: seen.append({w.model for w in cache.get()})
    cache.get(fresh=True)
    assert seen == [{"sim", "sim-lm"}]
    assert {w.model for w in cache.get()} == {"sim", "sim-lm"}


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
        assert [w.id for _, w in fleet.returning()] == ["gpu0@pod-last"]
    finally:
        client.delete(key, f"{key}:returning")
        client.close()
