"""The adapter pool and the step gate without a model: a fake loader, futures resolved by the loader thread.

AdapterPool keeps tasks.policy.adapter_residency's LRU and pinning (tested there); here: a lease holds its adapter
until released, loads that fail answer their rows alone, a pool whose slots all hold pinned adapters refuses
rather than waits for ever, and a batch that gives up on a lease still waiting leaves nothing acquired. StepGate:
at most ``cap`` distinct adapters admitted, first come first served.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="bin/test installs the 'models' extra these tests need")

from gpu_worker.backends.interface import ItemError
from gpu_worker.backends.lora import Adapter, AdapterError
from gpu_worker.backends.lora_pool import AdapterPool, Lease, StepGate, give_up

WAIT_S = 10


def fake_load(name: str, path: str) -> Adapter:
    if not Path(path).name.startswith("ok"):
        raise AdapterError(f"no adapter_config.json in {path!r}")
    return Adapter(name, path, {}, 4, 0)


def lease(pool: AdapterPool, name: str, pinned: bool = False) -> Lease | ItemError:
    return pool.request(name, f"/x/ok-{name}", pinned).result(WAIT_S)


def test_a_lease_holds_its_adapter_until_released() -> None:
    pool = AdapterPool(1, fake_load)
    a = lease(pool, "a")
    assert isinstance(a, Lease) and a.adapter.name == "a"
    b = pool.request("b", "/x/ok-b")  # no slot: a is in use
    assert not b.done() and pool.state().resident == ("a",)
    a.release()
    a.release()  # idempotent
    got = b.result(WAIT_S)
    assert isinstance(got, Lease) and pool.state().resident == ("b",)
    assert (pool.state().loads, pool.state().evictions) == (2, 1)
    pool.close()


def test_a_failed_load_answers_its_rows_and_holds_no_slot() -> None:
    pool = AdapterPool(1, fake_load)
    futures = [pool.request("bad", "/x/missing") for _ in range(2)]
    for f in futures:
        out = f.result(WAIT_S)
        assert isinstance(out, ItemError) and out.type == "invalid_request" and "adapter_config" in out.message
    assert pool.state().resident == () and pool.state().loading == ()
    assert isinstance(lease(pool, "a"), Lease)
    pool.close()


def test_slots_all_pinned_refuse_a_new_adapter() -> None:
    pool = AdapterPool(1, fake_load)
    held = lease(pool, "p", pinned=True)
    assert isinstance(held, Lease)
    held.release()
    out = lease(pool, "q")
    assert isinstance(out, ItemError) and "pinned" in out.message
    assert pool.state().resident == ("p",)
    pool.close()


def test_an_unexpected_loader_failure_is_an_item_error_too() -> None:
    def boom(name: str, path: str) -> Adapter:
        raise MemoryError("no room")

    pool = AdapterPool(2, boom)
    out = lease(pool, "a")
    assert isinstance(out, ItemError) and "MemoryError" in out.message
    pool.close()


def test_giving_up_on_a_waiting_lease_acquires_nothing() -> None:
    gate = threading.Event()

    def slow(name: str, path: str) -> Adapter:
        assert gate.wait(WAIT_S)
        return fake_load(name, path)

    pool = AdapterPool(1, slow)
    waiting = pool.request("a", "/x/ok-a")
    give_up([waiting])
    gate.set()
    deadline = time.monotonic() + WAIT_S
    while pool.state().resident != ("a",) and time.monotonic() < deadline:  # the load ends on the loader thread
        time.sleep(0.01)
    assert pool.state().resident == ("a",) and not pool.residency.in_use
    assert isinstance(lease(pool, "a"), Lease)
    pool.close()


def test_a_name_with_a_new_directory_is_loaded_again() -> None:
    pool = AdapterPool(2, fake_load)
    first = lease(pool, "a")
    assert isinstance(first, Lease)
    first.release()
    again = pool.request("a", "/x/ok-a-v2").result(WAIT_S)
    assert isinstance(again, Lease) and again.adapter.path == "/x/ok-a-v2" and pool.state().loads == 2
    pool.close()


def test_a_pool_without_slots_refuses_at_once() -> None:
    out = AdapterPool(0, fake_load).request("a", "/x/ok-a").result(0)
    assert isinstance(out, ItemError) and "LLMB_MAX_ADAPTERS=0" in out.message


def admit(gate: StepGate, *rows: tuple[str, str]) -> list[str]:
    admitted: list[str] = []
    for rid, adapter in rows:
        admitted += gate.offer(rid, adapter)
    return admitted


def test_the_gate_admits_at_most_cap_distinct_adapters() -> None:
    gate = StepGate(2)
    assert admit(gate, ("r1", "a"), ("r2", "b"), ("r3", "a"), ("r4", "c"), ("r5", "a")) == ["r1", "r2", "r3", "r5"]
    assert gate.ended("r1") == [] and set(gate.active) == {"a", "b"}  # a still runs r3 and r5
    assert gate.ended("r2") == ["r4"] and set(gate.active) == {"a", "c"}  # b's slot goes to the waiting c
    gate.ended("r9")  # unknown: nothing happens
    assert gate.ended("r3") == [] and gate.ended("r5") == [] and set(gate.active) == {"c"}


def test_running_adapters_pass_a_waiting_row_only_so_often() -> None:
    """With a bypass of 1, the second row of a running adapter waits behind c's row: a drains, c gets its slot."""
    gate = StepGate(1, bypass=1)
    assert admit(gate, ("r1", "a"), ("r2", "c"), ("r3", "a"), ("r4", "a")) == ["r1", "r3"]
    assert gate.ended("r1") == [] and gate.ended("r3") == ["r2"]  # c first, then a's row waits for c to end
    assert gate.ended("r2") == ["r4"]


def test_the_oldest_waiting_row_gets_the_free_slot() -> None:
    gate = StepGate(1)
    assert admit(gate, ("r1", "a"), ("r2", "b"), ("r3", "c")) == ["r1"]
    assert gate.ended("r2") == []  # cancelled while waiting
    assert gate.ended("r1") == ["r3"]
