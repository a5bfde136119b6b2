"""The LoRA adapters one worker holds: LRU eviction, pinning, rows in use, loads in flight (pure, a fake clock)."""
from __future__ import annotations

from tasks.policy.adapter_residency import READY, WAIT, AdapterResidency, Plan
from tasks.schema import SamplingParams, WorkerInfo


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def resident(r: AdapterResidency, *names: str) -> None:
    for n in names:
        plan = r.plan(n)
        assert plan.load
        r.start_load(n, plan.evict)
        r.loaded(n)


def test_a_load_fills_free_room_then_evicts_the_least_recently_used() -> None:
    r = AdapterResidency(2, Clock())
    assert r.plan("a") == Plan(load=True)
    resident(r, "a", "b")
    assert r.plan("a") is READY
    r.acquire("a")  # a used since b: b is the least recently used
    r.release("a")
    assert r.plan("c") == Plan(load=True, evict=("b",))
    resident(r, "c")
    assert r.names() == ("c", "a") and (r.loads, r.evictions) == (3, 1)


def test_pinned_and_in_use_adapters_are_never_evicted() -> None:
    r = AdapterResidency(2, Clock())
    resident(r, "a", "b")
    r.pin("a")
    r.acquire("b")
    assert r.plan("c") is WAIT, "a pinned, b running: no room until b's row ends"
    r.release("b")
    assert r.plan("c") == Plan(load=True, evict=("b",))
    assert not r.drop("zzz") and r.drop("a") and "a" not in r.pinned


def test_a_loading_adapter_is_waited_for_and_counts_against_the_room() -> None:
    r = AdapterResidency(1, Clock())
    r.start_load("a")
    assert r.plan("a") is WAIT and r.plan("b") is WAIT  # a's load holds the one place
    r.failed("a")
    assert r.plan("b") == Plan(load=True) and r.names() == ()
    assert AdapterResidency(0, Clock()).plan("a") is WAIT, "a worker with no adapter room serves none"


def test_a_row_in_use_cannot_be_dropped_until_released() -> None:
    r = AdapterResidency(2, Clock())
    resident(r, "a")
    r.acquire("a")
    r.acquire("a")
    r.release("a")
    assert not r.drop("a")
    r.release("a")
    assert r.drop("a") and r.names() == ()


def test_the_wire_forms_carry_the_adapter_and_older_readers_skip_it() -> None:
    p = SamplingParams(max_tokens=4, adapter="team-a", adapter_path="/adapters/team-a")
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert "adapter" not in SamplingParams(max_tokens=4).to_dict()
    w = WorkerInfo("w@h", "q", "m", 8, "idle", 0, 0, None, 0.0, 0.0, max_adapters=4, adapters=("a", "b"),
                   adapters_loading=("c",))
    assert WorkerInfo.from_json(w.to_json()) == w
