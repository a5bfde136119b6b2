"""The intake pace of an API process (webapp/intake.py): tokens per tick, first come first served, no timer
while idle."""
from __future__ import annotations

import gevent

from webapp.intake import Intake


def wait_until(predicate: object, timeout_s: float = 5.0) -> None:
    with gevent.Timeout(timeout_s):
        while not predicate():  # type: ignore[operator]
            gevent.sleep(0.005)


def test_at_most_per_tick_requests_start_in_one_tick_and_in_arrival_order() -> None:
    intake = Intake(per_tick=4, tick_s=0.2)
    started: list[int] = []
    waits: dict[int, float | None] = {}

    def request(i: int) -> None:
        waits[i] = intake.take()
        started.append(i)

    greenlets = [gevent.spawn(request, i) for i in range(10)]
    wait_until(lambda: len(started) == 4 and intake.waiting == 6)
    assert started == [0, 1, 2, 3]  # the rest wait for the next tick
    wait_until(lambda: len(started) == 8)
    assert started == list(range(8))
    gevent.joinall(greenlets, timeout=5)
    assert started == list(range(10))
    # the first four went at once; the others say how long they waited in line (at least a tick for 4-7)
    assert [waits[i] for i in range(4)] == [None] * 4
    assert all((waits[i] or 0.0) >= 0.2 for i in range(4, 10))


def test_an_idle_process_runs_no_timer_and_takes_at_once() -> None:
    intake = Intake(per_tick=2, tick_s=0.05)
    intake.take()
    assert intake._refilling
    wait_until(lambda: not intake._refilling)  # refilled, then nothing taken for a tick: the timer stops
    for _ in range(2):
        with gevent.Timeout(0.01):  # a full bucket: no wait
            intake.take()


def test_the_expected_wait_is_the_line_at_the_measured_rate() -> None:
    """What the door refuses by at a request's arrival: a burst's whole line arrives before anyone has waited, so
    the wait so far says nothing yet; the line over the rate does."""
    intake = Intake(per_tick=4, tick_s=0.05)
    assert intake.expected_wait_s() == 0.0
    greenlets = [gevent.spawn(intake.take) for _ in range(40)]
    wait_until(lambda: intake.waiting == 36)
    bound = intake.per_tick / intake.tick_s
    assert intake.expected_wait_s() >= 36 / bound  # at most the bound's rate: the wait is never under-told
    wait_until(lambda: intake.rate < bound)  # a tick spent behind is measured (a tick lasts at least tick_s)
    gevent.joinall(greenlets, timeout=5)
    assert intake.waiting == 0 and intake.expected_wait_s() == 0.0


def test_a_request_refused_at_its_turn_gives_its_token_back() -> None:
    """A refusal at a request's turn is one write: the next in line takes its token at once, not a tick later."""
    intake = Intake(per_tick=2, tick_s=0.5)
    started: list[int] = []

    def request(i: int) -> None:
        intake.take()
        started.append(i)
        if i < 2:
            intake.give_back()  # the first two are refused at their turn

    greenlets = [gevent.spawn(request, i) for i in range(4)]
    wait_until(lambda: len(started) == 4, timeout_s=0.4)  # all within the first tick
    gevent.joinall(greenlets, timeout=5)
    intake.give_back()
    assert intake._tokens.counter <= intake.per_tick  # never more tokens than a tick holds
