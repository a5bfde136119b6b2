"""The turnstile in front of admission (tasks/gateway/gate.py) and the door's use of it, with an injected clock."""
from __future__ import annotations

import math
import time

import pytest

from tasks.errors import Overloaded
from tasks.gateway.gate import Gate
from tasks.policy.callers import RecentCallers
from tasks.policy.shedding import Door
from tests.fakes import FakeClock
from webapp.errors import status_of


def wait(gate: Gate, n: int, since: float) -> None:
    """As if ``n`` calls had started waiting for their turn at ``since`` (what their passages record)."""
    gate._since.update((object(), since) for _ in range(n))


def test_the_drain_rate_is_measured_and_gives_the_expected_wait_and_retry_after() -> None:
    clock = FakeClock(start=100.0)
    gate = Gate(slots=2, max_wait_s=1.0, clock=clock)
    assert gate.expected_wait_s() == 0.0 and gate.retry_after_s() == 1  # nothing measured, nothing waiting
    for _ in range(50):  # each call holds its slot 20 ms: two slots drain 100 calls a second
        with gate.passage():
            clock.advance(0.02)
    assert gate.drain_rate() == pytest.approx(100)
    wait(gate, 300, since=clock.now)
    assert gate.expected_wait_s() == pytest.approx(3.0)
    assert gate.retry_after_s() == math.ceil(gate.expected_wait_s())  # the queue at its drain rate, not a constant


def test_a_call_that_waits_too_long_for_its_turn_is_refused() -> None:
    gate = Gate(slots=1, max_wait_s=0.05)  # a real clock: the wait is a real semaphore timeout
    with gate.passage():
        with pytest.raises(Overloaded) as late, gate.passage():
            pass
        assert status_of(late.value.type) == 429 and "for its turn" in late.value.message and gate.waiting == 0
    with gate.passage():  # the slot is free again
        pass


def test_the_door_refuses_before_the_body_a_call_that_could_not_get_its_turn_in_time() -> None:
    clock = FakeClock(start=100.0)
    gate = Gate(slots=4, max_wait_s=1.0, clock=clock)
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, clock=clock, gate=gate)
    door.enter(clock.now)
    gate.hold_s = 0.04  # 4 slots of 40 ms: 100 calls a second
    wait(gate, 130, since=clock.now)  # 1.3 s of queue (it has 1 s)
    with pytest.raises(Overloaded) as refused:
        door.enter(clock.now)
    assert refused.value.retry_after_s == 2 and "would take 1300 ms" in refused.value.message
    assert door.held == 1  # a refusal holds nothing
    gate._since.clear()
    wait(gate, 50, since=clock.now)  # 0.5 s of queue: let in, unless it has already waited 0.6 s to get to the door
    door.enter(clock.now)
    with pytest.raises(Overloaded):
        door.enter(clock.now - 0.6)
    assert door.held == 2


def test_a_call_the_door_let_in_by_its_line_on_arrival_is_refused_there_only_when_late() -> None:
    """A call placed in its model's line as it arrived had its turn reckoned then, at the pace the process takes
    calls through; the gate's expected wait (slots over the mean time in one: a burst's first rounds, held up by
    the burst's arrivals, read as the process's pace) does not refuse it again in front of Flask. Lateness does."""
    clock = FakeClock(start=100.0)
    gate = Gate(slots=4, max_wait_s=1.0, clock=clock)
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, clock=clock, gate=gate)
    gate.hold_s = 0.4  # 4 slots of 400 ms: 10 calls a second
    wait(gate, 130, since=clock.now)  # 13 s of queue by that estimate
    with pytest.raises(Overloaded):
        door.enter(clock.now)
    door.enter(clock.now, in_line=True)
    door.enter(clock.now - 0.9, in_line=True)
    with pytest.raises(Overloaded) as late:
        door.enter(clock.now - 1.2, in_line=True)  # got to 1.2 s after it arrived: past the bound
    assert "behind" in late.value.message and door.held == 2


def test_a_light_caller_is_let_in_while_a_heavy_one_is_refused() -> None:
    clock = FakeClock(start=100.0)
    door = Door(limit=10_000, retry_after_s=1, max_delay_s=1.0, clock=clock)
    for i in range(500):
        clock.advance(0.002)  # the flood: 500 a second
        door.enter(clock.now, "flood")
        if i % 100 == 0:
            door.enter(clock.now, "steady")  # 5 a second
    late = clock.now - 1.5  # the process is 1.5 s behind
    with pytest.raises(Overloaded):
        door.enter(late, "flood")
    door.enter(late, "steady")  # well under an even share of the recent requests: let in
    door.enter(late, "", identify=lambda: "steady")  # named only in its body, read when about to refuse
    alone = Door(limit=10_000, retry_after_s=1, max_delay_s=1.0, clock=clock)
    with pytest.raises(Overloaded):  # a single caller is never "light": shedding still works for it
        alone.enter(late, "only")


def test_recent_callers_forget_after_their_window() -> None:
    from tasks.policy.callers import RecentCallers

    clock = FakeClock(start=100.0)
    callers = RecentCallers(clock)
    for _ in range(100):
        callers.arrived("a")
    callers.arrived("b")
    assert callers.light("b") and not callers.light("a")
    clock.advance(5)
    assert callers.light("b")  # the last five seconds still count (a flood's backlog drains for a while)
    clock.advance(1.5)
    callers.arrived("b")
    assert not callers.light("b")  # "a" is forgotten: "b" alone


def test_a_light_tenant_passes_beside_a_floods_full_slots() -> None:
    """Tenant a fills the only slot and sends far more; tenant b, sending a call now and then, passes at once
    instead of waiting behind a's queue (which would refuse it after max_wait_s like a's)."""
    gate = Gate(slots=1, max_wait_s=0.05)
    for _ in range(40):
        with gate.passage("a"):
            pass
    with gate.passage("a"):
        with gate.passage("b") as turn:  # no slot is free: b is light
            assert turn is not None and gate.waiting == 0
        with pytest.raises(Overloaded), gate.passage("a"):  # a is the flood: refused after max_wait_s
            pass



def test_a_flood_of_calls_refused_or_through_leaves_nothing_in_the_gate() -> None:
    """The gate keeps one entry per call waiting now, none per model or caller name (its count of recent callers
    is :mod:`tasks.policy.callers`'s, bounded there): a flood refused for want of a turn leaves it empty."""
    clock = FakeClock(start=100.0)
    gate = Gate(slots=1, max_wait_s=0.0, clock=clock)
    with gate.passage():  # the one slot taken: every other call is refused at once
        for _ in range(2_000):
            with pytest.raises(Overloaded), gate.passage():
                pass
    for _ in range(2_000):
        with gate.passage():
            clock.advance(0.0001)
    assert gate.waiting == 0 and gate._since == {}


def test_a_gate_reading_the_doors_count_tells_a_light_tenant_by_every_arrival() -> None:
    """The door counts every arrival, the flood's it refuses among them; a gate counting for itself sees only the
    calls that reach it. Before: the gate kept its own count, so beside a flood the door turned away the steady
    tenant looked heavy there and waited for a slot (0.18-0.48 s a call, measured) while the door judged it
    light. The process's door is built on the gate's count (``door_from_settings``), which it then keeps."""
    from tasks.config import Settings
    from webapp.door import door_from_settings

    counted = Gate(slots=1, max_wait_s=0.05, callers=RecentCallers(time.monotonic))
    door = door_from_settings(Settings.of(), counted)
    assert door.callers is counted.callers
    alone = Gate(slots=1, max_wait_s=0.05)
    for gate in (counted, alone):
        for _ in range(10):
            with gate.passage("steady"):  # the steady tenant's calls of the last seconds
                door.callers.arrived("steady") if gate is counted else None
    for _ in range(200):
        door.callers.arrived("flood")  # arrivals the door refused: they never reach a gate
    for gate in (counted, alone):
        with gate.passage():  # a call holds the only slot
            if gate is counted:
                with gate.passage("steady") as turn:  # light by the door's count: passes at once
                    assert turn is not None and gate.waiting == 0
            else:
                with pytest.raises(Overloaded), gate.passage("steady"):  # by its own count it is the heavy one
                    pass
