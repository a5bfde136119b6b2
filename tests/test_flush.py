"""The flush policy, as the batcher's buffer applies it, driven by a fake clock: no sleeping, no broker."""
from __future__ import annotations

import pytest

from tasks.policy.fairness import FairBuffer
from tasks.policy.flush import FlushPolicy


def buffer(size: int = 3, wait_s: float = 0.020) -> FairBuffer[str]:
    return FairBuffer(FlushPolicy(max_batch_size=size, max_wait_s=wait_s))


def test_empty_buffer_is_never_ready_and_sets_no_timer() -> None:
    b = buffer()
    assert not b.is_ready(now=1_000.0)
    assert b.seconds_until_ready(now=1_000.0) is None
    assert b.take() == []
    assert b.drop_expired(now=1_000.0) == []


def test_size_trigger_fires_at_max_batch_size_without_waiting() -> None:
    b = buffer(size=3)
    for i in range(2):
        b.add(f"r{i}", now=10.0, deadline=99.0)
    assert not b.is_ready(now=10.0)
    b.add("r2", now=10.0, deadline=99.0)
    assert b.is_ready(now=10.0)
    assert b.seconds_until_ready(now=10.0) == 0.0
    assert [p.item for p in b.take()] == ["r0", "r1", "r2"]
    assert len(b) == 0


def test_take_never_returns_more_than_max_batch_size() -> None:
    b: FairBuffer[int] = FairBuffer(FlushPolicy(max_batch_size=100))
    for i in range(150):
        b.add(i, now=0.0, deadline=99.0)
    assert len(b.take()) == 100
    assert len(b) == 50


def test_wait_trigger_counts_from_the_first_item_not_the_latest() -> None:
    b = buffer(size=100, wait_s=0.020)
    b.add("first", now=5.000, deadline=99.0)
    b.add("second", now=5.015, deadline=99.0)
    assert not b.is_ready(now=5.019)
    assert b.seconds_until_ready(now=5.015) == pytest.approx(0.005)
    assert b.is_ready(now=5.020)  # 20 ms after the first item, though the second waited only 5 ms


def test_items_left_behind_keep_their_own_arrival_time() -> None:
    b = buffer(size=2, wait_s=0.020)
    b.add("a", now=0.000, deadline=99.0)
    b.add("b", now=0.001, deadline=99.0)
    b.add("c", now=0.010, deadline=99.0)
    assert [p.item for p in b.take()] == ["a", "b"]
    assert b.seconds_until_ready(now=0.011) == pytest.approx(0.019)  # c's timer started at 0.010


def test_expired_items_are_dropped_before_a_batch_is_formed() -> None:
    b = buffer(size=3)
    b.add("stale", now=0.0, deadline=1.0)
    b.add("fresh", now=0.0, deadline=5.0)
    b.add("edge", now=0.0, deadline=2.0)
    assert b.drop_expired(now=2.0) == ["stale", "edge"]  # a deadline at exactly now has passed
    assert [p.item for p in b.take()] == ["fresh"]


def test_put_back_restores_order_and_arrival() -> None:
    b = buffer(size=2, wait_s=0.020)
    b.add("a", now=0.0, deadline=9.0)
    b.add("b", now=0.0, deadline=9.0)
    b.add("c", now=0.005, deadline=9.0)
    taken = b.take()
    b.put_back(taken)
    assert [p.item for p in b] == ["a", "b", "c"]
    assert b.oldest_interactive() == 0.0


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be at least 1"):
        FlushPolicy(max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_s must not be negative"):
        FlushPolicy(max_wait_s=-1)
