"""sim-lm's LoRA adapters: the cost model against its published anchors, the per-step cap, loads off the step loop
and the resident limit, on the pure engine with a fake clock (no sleeps), then the backend's heartbeat view."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_worker.backends.generation import Row
from gpu_worker.backends.interface import NO_ADAPTERS, ItemError
from gpu_worker.backends.sim_lm import SimLMBackend
from gpu_worker.backends.sim_lm_adapters import AdapterCosts, AdapterGate, AdapterShape, adapter_shape
from gpu_worker.backends.sim_lm_engine import Engine, Seq, Timing
from gpu_worker.backends.sim_lm_kv import KVCache
from gpu_worker.backends.sim_lm_text import GREEDY, Text
from tasks.policy.adapter_residency import AdapterResidency
from tasks.schema import SamplingParams
from tests.fakes import FakeClock
from tests.outputs import generated


def seq(index: int, adapter: str | None, max_tokens: int = 4) -> Seq:
    return Seq(Row(index, [index % 7] * 8, max_tokens, []), Text(f"p{index}", GREEDY), None, adapter=adapter)


class Loads:
    """The gate's loader, run by hand: what was asked for, finished when the test says."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float]] = []


def engine_with(capacity: int = 4, per_step: int = 2) -> tuple[Engine, AdapterGate, Loads]:
    loads = Loads()
    gate = AdapterGate(AdapterResidency(capacity, FakeClock()), per_step, AdapterCosts(),
                       lambda name, ms: loads.asked.append((name, ms)))
    return Engine(Timing(), KVCache(100_000, 16), max_seqs=64, adapters=gate), gate, loads


def add(engine: Engine, gate: AdapterGate, s: Seq) -> None:
    if s.adapter is not None:
        gate.arrived(s.adapter, None, False)
    engine.add(s)


def test_one_rank_64_adapter_costs_vllms_25_percent_and_more_adapters_little_more() -> None:
    costs = AdapterCosts()
    assert costs.step_factor([]) == 1.0
    assert costs.step_factor([64]) == pytest.approx(1.25)  # vLLM: one rank-64 adapter on Llama-7B, 25% slower
    assert costs.step_factor([64] * 4) == pytest.approx(1.31)  # Punica/S-LoRA: slowly with distinct adapters
    assert 1.0 < costs.step_factor([8]) < costs.step_factor([16]) < costs.step_factor([64])


def test_load_time_is_a_fixed_part_plus_the_bytes_over_pcie() -> None:
    costs = AdapterCosts()
    small = AdapterShape(16)  # q_proj + v_proj of 32 layers, fp16
    assert small.bytes == 16 * (8192 + 8192) * 2 * 32
    assert costs.load_ms(small) == pytest.approx(5 + small.bytes / 25e9 * 1000)
    big = AdapterShape(64, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert costs.load_ms(big) > 3 * costs.load_ms(small)


def test_the_rank_is_read_from_adapter_config_json(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 64, "target_modules": ["q_proj", "o_proj"]}))
    assert adapter_shape(str(tmp_path), 16) == AdapterShape(64, ("q_proj", "o_proj"))
    assert adapter_shape(str(tmp_path / "missing"), 16) == AdapterShape(16)
    assert adapter_shape(None, 8) == AdapterShape(8)


def test_a_row_waits_for_its_adapters_load_while_the_others_keep_stepping() -> None:
    engine, gate, loads = engine_with()
    add(engine, gate, seq(0, None))
    add(engine, gate, seq(1, "a"))
    assert [name for name, _ in loads.asked] == ["a"] and gate.residency.loading == {"a"}
    first = engine.step()
    assert first.running == 1 and [s.row.index for s in engine.waiting] == [1]
    assert first.ms == pytest.approx(Timing().step(1, first.prefill_tokens))  # base-only step: no adapter cost
    gate.loaded("a")
    second = engine.step()
    assert second.running == 2 and engine.running_adapters() == {"a"}
    assert second.ms == pytest.approx(Timing().step(2, second.prefill_tokens) * AdapterCosts().step_factor([16]))
    assert gate.state().resident == ("a",) and gate.state().loads == 1 and gate.misses == 1


def test_at_most_per_step_distinct_adapters_run_and_the_next_joins_when_one_drains() -> None:
    engine, gate, _ = engine_with(capacity=4, per_step=2)
    for i, name in enumerate(["a", "b", "c", "a"]):
        add(engine, gate, seq(i, name, max_tokens=2 + i))
    for name in "abc":
        gate.loaded(name)
    engine.step()
    assert engine.running_adapters() == {"a", "b"} and {s.row.index for s in engine.running} == {0, 1, 3}
    assert [s.adapter for s in engine.waiting] == ["c"]
    while engine.waiting:
        engine.step()
        assert len(engine.running_adapters()) <= 2
    assert "c" in engine.running_adapters()


def test_the_resident_limit_evicts_the_least_recently_used_idle_adapter_never_one_in_use() -> None:
    engine, gate, loads = engine_with(capacity=2, per_step=4)
    add(engine, gate, seq(0, "a", max_tokens=50))
    add(engine, gate, seq(1, "b", max_tokens=1))
    gate.loaded("a")
    gate.loaded("b")
    engine.step()
    engine.step()  # b's row is done: b is idle, a still runs
    add(engine, gate, seq(2, "c"))
    assert gate.residency.evictions == 1 and "b" not in gate.residency.resident and "a" in gate.residency.resident
    add(engine, gate, seq(3, "d"))  # a in use, c loading: no room, d waits without a load
    assert [name for name, _ in loads.asked] == ["a", "b", "c"]
    gate.loaded("c")
    engine.step()
    assert gate.state().resident[0] == "c" and gate.state().loading == ()


def test_pinned_adapters_are_never_evicted() -> None:
    _, gate, _ = engine_with(capacity=1, per_step=4)
    gate.arrived("p", None, True)
    gate.loaded("p")
    gate.arrived("q", None, False)
    assert gate.residency.resident.keys() == {"p"} and gate.residency.loading == set()


def test_the_backend_loads_off_the_loop_and_reports_its_adapters() -> None:
    b = SimLMBackend(speed=1000, max_adapters=2, adapters_per_step=2, eos_mean=0)
    try:
        params = [SamplingParams(max_tokens=3, temperature=0, adapter=name) for name in ("x", "y", "z", "x")]
        params.append(SamplingParams(max_tokens=3, temperature=0))
        out = generated(b.run([f"hello {i}" for i in range(5)], params))
        assert [o.completion_tokens for o in out] == [3] * 5
        state = b.adapters()
        assert state.max_adapters == 2 and len(state.resident) == 2 and state.loads == 3 and state.evictions == 1
        assert state.loading == ()
    finally:
        b.close()


@pytest.mark.parametrize(("mode", "max_adapters"), [("continuous", 0), ("static", 4)])
def test_a_worker_without_adapters_refuses_a_row_naming_one_and_serves_the_rest(mode: str, max_adapters: int) -> None:
    b = SimLMBackend(mode=mode, speed=1000, eos_mean=0, max_adapters=max_adapters)  # static mode models none
    try:
        out = b.run(["a", "b"], [SamplingParams(max_tokens=2, adapter="x"), SamplingParams(max_tokens=2)])
        assert isinstance(out[0], ItemError) and out[0].type == "invalid_request"
        assert generated(out[1:])[0].completion_tokens == 2 and b.adapters() == NO_ADAPTERS
    finally:
        b.close()


def test_rows_without_adapters_cost_what_they_did() -> None:
    elapsed = []
    for max_adapters in (0, 4):
        clock = FakeClock(start=0.0)
        b = SimLMBackend(eos_mean=0, clock=clock, sleep=clock.sleep, max_adapters=max_adapters)
        try:
            b.run(["one two three", "four"], [SamplingParams(max_tokens=n, temperature=0) for n in (5, 3)])
            elapsed.append(clock.now)
        finally:
            b.close()
    assert elapsed[0] > 0 and elapsed[1] == pytest.approx(elapsed[0])
