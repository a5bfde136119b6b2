"""The door's view of a model's line (tasks.policy.room): pure, on an injected clock."""
from __future__ import annotations

from tasks.policy.room import Room

KEY = ("sim", "interactive")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_nothing_is_known_of_is_empty_and_not_tight() -> None:
    room = Room(processes=2, pending_ttl_s=3.0, clock=Clock())
    assert room.place(KEY) == 0 and room.waiting() == 0


def test_requests_let_in_count_for_every_process_sharing_the_load_until_their_verdict() -> None:
    clock = Clock()
    room = Room(processes=2, pending_ttl_s=3.0, clock=clock)
    for _ in range(5):
        room.let_in(KEY)
    assert room.place(KEY) == 10 and room.waiting() == 5  # the other process is taking in its part too
    room.decided(KEY, count=40, rate=400.0)  # admitted: the model counts 40 items, this one among them
    room.ended(KEY)  # ... and through admission
    assert room.waiting() == 4 and room.place(KEY) == 40 + 2 * 4
    room.ended(KEY)  # one through admission without a verdict (a Redis outage's 503): it stops counting too
    assert room.waiting() == 3 and room.place(KEY) == 40 + 2 * 3
    assert room.place(("sim", "offline")) == 0  # another class's line is another line


def test_the_count_drains_at_the_fleets_rate_and_never_below_nothing() -> None:
    clock = Clock()
    room = Room(processes=1, pending_ttl_s=3.0, clock=clock)
    room.decided(KEY, count=100, rate=400.0)
    clock.now += 0.1
    assert round(room.place(KEY), 6) == 60  # 40 answered in 100 ms
    clock.now += 1.0
    assert room.place(KEY) == 0


def test_a_request_let_in_that_never_gets_a_verdict_stops_counting() -> None:
    clock = Clock()
    room = Room(processes=2, pending_ttl_s=3.0, clock=clock)
    room.let_in(KEY)
    clock.now += 2.0
    room.let_in(KEY)
    clock.now += 1.5  # the first is 3.5 s old: a 400, or a caller gone
    assert room.waiting() == 1 and room.place(KEY) == 2


def test_every_line_counts_towards_the_wait_for_a_turn() -> None:
    room = Room(processes=2, pending_ttl_s=3.0, clock=Clock())
    for key in (KEY, KEY, ("sim", "offline"), ("other", "interactive")):
        room.let_in(key)
    assert room.waiting() == 4  # this process's own calls, of every line: they all go through its admission first


def test_the_pace_is_of_calls_through_admission_while_others_wait_over_the_last_second() -> None:
    clock = Clock()
    room = Room(processes=1, pending_ttl_s=10.0, clock=clock)
    for _ in range(40):
        room.ended(KEY)  # nobody waits behind them: idle calls tell no pace
        clock.now += 0.001
    assert room.pace() is None
    for _ in range(100):
        room.let_in(KEY)
    for _ in range(15):
        clock.now += 0.01
        room.ended(KEY)
    assert room.pace() is None  # too few to tell
    for _ in range(35):
        clock.now += 0.01
        room.ended(KEY)
    assert round(room.pace() or 0, 6) == round(50 / 0.49, 6)  # 50 through from the first to now: 100 a second
    clock.now += 0.5  # a stall: none through for half a second
    assert round(room.pace() or 0, 6) == round(50 / 0.99, 6)
    clock.now += 0.6  # the window has passed them all
    assert room.pace() is None
