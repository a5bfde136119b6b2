"""The door's view of a model's line (tasks.policy.room): pure, on an injected clock."""
from __future__ import annotations

from tasks.policy.room import PACE_WINDOW_S, Room
from tests.fakes import FakeClock

KEY = ("sim", "interactive")


def test_a_line_nothing_is_known_of_is_empty_and_not_tight() -> None:
    room = Room(processes=2, pending_ttl_s=3.0, clock=FakeClock())
    assert room.place(KEY) == 0 and room.waiting() == 0


def test_requests_let_in_count_for_every_process_sharing_the_load_until_their_verdict() -> None:
    clock = FakeClock()
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
    clock = FakeClock()
    room = Room(processes=1, pending_ttl_s=3.0, clock=clock)
    room.decided(KEY, count=100, rate=400.0)
    clock.advance(0.1)
    assert round(room.place(KEY), 6) == 60  # 40 answered in 100 ms
    clock.advance(1.0)
    assert room.place(KEY) == 0


def test_a_request_let_in_that_never_gets_a_verdict_stops_counting() -> None:
    clock = FakeClock()
    room = Room(processes=2, pending_ttl_s=3.0, clock=clock)
    room.let_in(KEY)
    clock.advance(2.0)
    room.let_in(KEY)
    clock.advance(1.5)  # the first is 3.5 s old: a 400, or a caller gone
    assert room.waiting() == 1 and room.place(KEY) == 2


def test_every_line_counts_towards_the_wait_for_a_turn() -> None:
    room = Room(processes=2, pending_ttl_s=3.0, clock=FakeClock())
    for key in (KEY, KEY, ("sim", "offline"), ("other", "interactive")):
        room.let_in(key)
    assert room.waiting() == 4  # this process's own calls, of every line: they all go through its admission first


def test_the_pace_is_of_calls_through_admission_while_others_wait_over_the_last_second() -> None:
    clock = FakeClock()
    room = Room(processes=1, pending_ttl_s=10.0, clock=clock)
    for _ in range(40):
        room.ended(KEY)  # nobody waits behind them: idle calls tell no pace
        clock.advance(0.0001)  # a second in all: the pending request is still counted
    assert room.pace() is None
    for _ in range(100):
        room.let_in(KEY)
    for _ in range(15):
        clock.advance(0.01)
        room.ended(KEY)
    assert room.pace() is None  # too few to tell
    for _ in range(35):
        clock.advance(0.01)
        room.ended(KEY)
    assert round(room.pace() or 0, 6) == round(50 / 0.49, 6)  # 50 through from the first to now: 100 a second
    clock.advance(0.5)  # a stall: none through for half a second
    assert round(room.pace() or 0, 6) == round(50 / 0.99, 6)
    clock.advance(0.6)  # the window has passed them all
    assert room.pace() is None


def test_the_pace_reads_at_least_its_starting_figure_in_the_first_second_of_a_busy_spell() -> None:
    """A burst's first admission rounds wait for the process's connections and turns to be set up: the pace they
    show is not the process's. Through the first window of a spell of calls through while others wait, the pace
    is read as at least ``starting``; after it, as measured; a spell after a gap starts again."""
    clock = FakeClock()
    room = Room(processes=1, pending_ttl_s=10.0, clock=clock)
    for _ in range(100):
        room.let_in(KEY)
    for _ in range(20):  # 100 a second, the first 0.2 s of the spell
        clock.advance(0.01)
        room.ended(KEY)
    assert room.pace(400.0) == 400.0 and round(room.pace() or 0, 6) == round(20 / 0.19, 6)
    for _ in range(90):  # on past a whole window at 100 a second
        clock.advance(0.01)
        room.ended(KEY)
    assert round(room.pace(400.0) or 0, 6) == round(room.pace() or 0, 6) < 400.0
    clock.advance(2.0)  # nothing through for longer than the window: the next calls begin a new spell
    for _ in range(100):
        room.let_in(KEY)
    for _ in range(20):
        clock.advance(0.01)
        room.ended(KEY)
    assert room.pace(400.0) == 400.0
    for _ in range(300):  # faster than the starting figure: as measured
        room.let_in(KEY)
        clock.advance(0.0001)
        room.ended(KEY)
    assert (room.pace(400.0) or 0) > 400.0


def test_a_flood_of_lines_keeps_at_most_max_lines_idle_ones_evicted_first() -> None:
    clock = FakeClock()
    room = Room(processes=1, pending_ttl_s=3.0, clock=clock, max_lines=8)
    room.let_in(KEY)  # a busy line: a request pending
    for i in range(10_000):
        room.decided((f"model-{i}", "interactive"), count=0, rate=0.0)
        clock.advance(0.0001)  # a second in all: the pending request is still counted
    assert len(room) == 8, "bounded"
    assert room.waiting() == 1 and room.place(KEY) == 1, "the busy line outlived the idle flood"
    room.ended(KEY)
    assert room.waiting() == 0


def test_a_flood_of_busy_lines_evicts_the_least_lately_used() -> None:
    clock = FakeClock()
    room = Room(processes=1, pending_ttl_s=30.0, clock=clock, max_lines=4)
    for i in range(1_000):
        room.let_in((f"model-{i}", "interactive"))
    assert len(room) == 4 and room.waiting() == 4
    assert room.place(("model-999", "interactive")) == 1 and room.place(("model-0", "interactive")) == 0


def test_lines_of_models_no_longer_served_are_dropped_and_ending_one_keeps_nothing() -> None:
    room = Room(processes=1, pending_ttl_s=3.0, clock=FakeClock())
    room.let_in(KEY)
    room.let_in(("gone", "interactive"))
    room.keep_only(lambda key: key == KEY)
    assert len(room) == 1 and room.waiting() == 1
    room.ended(("never-seen", "interactive"))  # a call through admission whose line was never kept
    assert len(room) == 1


def test_the_pace_keeps_only_its_window_even_when_nothing_asks_for_it() -> None:
    clock = FakeClock()
    room = Room(processes=1, pending_ttl_s=1e9, clock=clock)
    room.let_in(("stuck", "interactive"))  # one request pending for good: every call through counts for the pace
    for _ in range(10_000):
        room.ended(KEY)
        clock.advance(0.01)
    assert len(room._paced) <= PACE_WINDOW_S / 0.01 + 1
