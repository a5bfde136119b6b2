"""The door's delay bound (:class:`tasks.policy.shedding.DelayBound`): a transient line may grow to the long bound,
a line that has stood is cut to the short one (CoDel's interval and target), with a fake clock."""
from __future__ import annotations

import pytest

from tasks.errors import Overloaded
from tasks.policy.shedding import DelayBound, Door
from tests.fakes import FakeClock


def test_a_transient_line_keeps_the_long_bound() -> None:
    bound = DelayBound(long_s=2.5, short_s=1.0, standing_after_s=2.0)
    assert bound.target_s == 0.5
    assert bound.observe(0.2, now=0.0) == 2.5
    assert bound.observe(1.8, now=0.1) == 2.5  # above the target since 0.1
    assert bound.observe(2.0, now=2.05) == 2.5  # 1.95 s above it: not yet standing
    assert bound.observe(0.4, now=2.09) == 2.5  # under the target: the line is gone
    assert bound.observe(2.0, now=3.0) == 2.5  # above again, counted afresh
    assert not bound.standing(4.9)


def test_a_line_that_stands_is_cut_to_the_short_bound_until_it_drains() -> None:
    bound = DelayBound(long_s=2.5, short_s=1.0, standing_after_s=2.0)
    bound.observe(0.8, now=10.0)
    assert bound.observe(0.9, now=11.0) == 2.5
    assert bound.observe(0.9, now=12.0) == 1.0  # above 0.5 s for 2 s: a steady overload
    assert bound.bound(30.0) == 1.0  # it stays short while no sojourn falls under the target
    assert bound.observe(0.7, now=30.0) == 1.0  # hovering at the short bound keeps it standing
    assert bound.observe(0.3, now=31.0) == 2.5  # drained under the target: a burst may use the long bound again


def test_without_a_short_bound_the_long_one_always_applies() -> None:
    bound = DelayBound(long_s=2.5)
    assert bound.short_s == 2.5
    for second in range(10):
        assert bound.observe(2.0, now=float(second)) == 2.5
    assert DelayBound(long_s=1.0, short_s=3.0).short_s == 1.0  # never longer than the long bound


def test_the_door_refuses_at_the_short_bound_once_its_line_has_stood() -> None:
    clock = FakeClock(start=0.0)
    door = Door(limit=10_000, retry_after_s=1, bound=DelayBound(2.5, 1.0, 2.0), clock=clock)
    for step in range(4):  # a line of 1.5 s for 1.5 s: still transient, every request let in
        clock.now = 100.0 + step * 0.5
        door.enter(arrived_at=clock.now - 1.5, caller=f"c{step % 2}")
    assert door.held == 4
    clock.now = 102.0  # the line has stood 2 s above 0.5 s: 1.5 s is now too late
    with pytest.raises(Overloaded, match="1500 ms behind"):
        door.enter(arrived_at=clock.now - 1.5, caller="c0")
    assert door.max_delay_s == 1.0
    door.enter(arrived_at=clock.now - 0.2, caller="c1")  # the line drained: a short wait resets it
    assert door.max_delay_s == 2.5
    door.enter(arrived_at=clock.now - 1.5, caller="c0")
    assert door.held == 6
