"""A burst told from a standing queue (tasks.policy.standing): pure, on an injected clock."""
from __future__ import annotations

from tasks.policy.standing import StandingQueue
from tests.fakes import FakeClock


def test_a_line_that_empties_within_the_interval_is_a_burst_not_a_standing_queue() -> None:
    clock = FakeClock()
    lines = StandingQueue(interval_s=3.0, target_s=1.0, clock=clock)
    assert not lines.standing("sim")  # nothing seen: good queue
    lines.observe("sim", 1500)  # a burst fills the line
    clock.advance(2.9)
    lines.observe("sim", 200)  # ... drains, still not empty
    assert not lines.standing("sim")
    lines.observe("sim", 0)  # empty (one batch per worker or less)
    clock.advance(0.2)
    lines.observe("sim", 300)  # the next burst starts its own interval
    clock.advance(2.9)
    assert not lines.standing("sim")


def test_a_line_that_has_not_emptied_for_the_interval_stands_until_it_empties() -> None:
    clock = FakeClock()
    lines = StandingQueue(interval_s=3.0, target_s=1.0, clock=clock)
    lines.observe("sim", 400)
    for _ in range(30):  # a steady overload: never empty
        clock.advance(0.1)
        lines.observe("sim", 350)
    assert lines.standing("sim")
    assert not lines.standing("other")  # another model's line is another line
    lines.observe("sim", -20)  # it emptied: good queue again at once
    assert not lines.standing("sim")


def test_an_interval_of_zero_never_stands() -> None:
    clock = FakeClock()
    lines = StandingQueue(interval_s=0.0, target_s=1.0, clock=clock)
    lines.observe("sim", 400)
    clock.advance(100.0)
    lines.observe("sim", 400)
    assert not lines.standing("sim")


def test_lines_are_bounded_and_dropped_with_their_model() -> None:
    clock = FakeClock()
    lines = StandingQueue(interval_s=3.0, target_s=1.0, clock=clock, max_keys=8)
    lines.observe("sim", 400)
    for i in range(1000):  # made-up keys never grow it past its bound
        lines.observe(f"m{i}", 10)
    assert len(lines) == 8 and not lines.standing("sim")  # the least lately seen went first
    lines.keep_only(lambda key: key in {"m999"})
    assert len(lines) == 1


def test_how_long_a_line_has_been_deeper_than_its_threshold() -> None:
    """busy_for: what admission's margin for the batches running reads (tasks.policy.capacity.full_batches_margin)."""
    clock = FakeClock()
    lines = StandingQueue(interval_s=0.0, target_s=0.0, clock=clock)
    assert lines.busy_for("sim") == 0.0  # never seen
    lines.observe("sim", 5)
    clock.advance(0.3)
    lines.observe("sim", 900)  # still deeper: the clock runs from the first look that saw it so
    clock.advance(0.2)
    assert lines.busy_for("sim") == 0.5
    lines.observe("sim", 0)  # back within it: from zero again
    assert lines.busy_for("sim") == 0.0
