"""The intake pace of an API process (webapp/intake.py): tokens per tick, first come first served, no timer
while idle."""
from __future__ import annotations

import io
import socket
from types import SimpleNamespace

import gevent
import pytest

from webapp.connections import AtDoor, NextRequest
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
    assert intake._tokens + intake._granted <= intake.per_tick  # never more tokens than a tick holds


def test_callers_waiting_are_served_in_turn_each_in_arrival_order() -> None:
    """A flood's line does not hold up another tenant's request that joins it: the callers waiting take the
    tokens in turn. Before: one line, first come first served, and a steady tenant's call that arrived as a
    flood began waited out the flood's line (up to a second, measured)."""
    intake = Intake(per_tick=2, tick_s=0.2)
    started: list[str] = []

    def request(caller: str) -> None:
        intake.take(lambda: caller)
        started.append(caller)

    greenlets = [gevent.spawn(request, "flood") for _ in range(8)]  # two take the tick's tokens, six wait
    wait_until(lambda: intake.waiting == 6)
    greenlets += [gevent.spawn(request, "steady") for _ in range(2)]  # behind six of the flood's
    wait_until(lambda: intake.waiting == 8)
    wait_until(lambda: len(started) == 4)  # the next tick: one each
    assert started == ["flood", "flood", "flood", "steady"]
    wait_until(lambda: len(started) == 6)
    assert started[4:] == ["flood", "steady"]  # each caller's own in arrival order
    gevent.joinall(greenlets, timeout=5)
    assert started.count("flood") == 8 and intake.waiting == 0 and not intake._lines


def test_a_flood_of_caller_names_keeps_no_more_lines_than_requests_waiting() -> None:
    """The lines are keyed by what callers send (an X-Tenant without keys): one per caller with a request
    waiting, gone once it is served, however many names come."""
    intake = Intake(per_tick=50, tick_s=0.01)
    for _ in range(50):
        intake.take()  # the tick's tokens: the rest wait
    greenlets = [gevent.spawn(intake.take, lambda i=i: f"name-{i}") for i in range(2000)]
    wait_until(lambda: intake.waiting > 0)
    assert len(intake._lines) <= intake.waiting
    gevent.joinall(greenlets, timeout=10)
    assert intake.waiting == 0 and not intake._lines and not intake._since


def test_a_request_killed_while_waiting_leaves_no_line_and_no_token_behind() -> None:
    intake = Intake(per_tick=1, tick_s=60.0)
    assert intake.take() is None
    waiting = gevent.spawn(intake.take, lambda: "gone")
    wait_until(lambda: intake.waiting == 1)
    waiting.kill()
    assert intake.waiting == 0 and not intake._lines


class _Parser:
    """gunicorn's parser as NextRequest sees it: the previous body read, nothing read ahead."""

    unreader = SimpleNamespace(buf=io.BytesIO())

    def finish_body(self, deadline: float) -> bool:
        return True


@pytest.mark.parametrize("judged", [AtDoor.LIGHT, AtDoor.USUAL, AtDoor.IN_LINE])
def test_a_light_callers_request_is_taken_in_at_once_while_the_others_wait_their_turn(judged: AtDoor) -> None:
    """Beside a flood's line at intake, a request the door judged a light caller's on arrival starts at once;
    any other waits for a token (here, none comes back for a minute)."""
    intake = Intake(per_tick=1, tick_s=60.0)
    assert intake.take() is None  # the tick's one token: the next request waits for the next tick
    server, client = socket.socketpair()
    with server, client:
        client.sendall(b"POST /v1/infer HTTP/1.1\r\n")
        asked: list[bool] = []

        def door(sock: socket.socket, waited_s: float | None, arriving: bool) -> AtDoor:
            asked.append(arriving)
            return judged

        wait = NextRequest(server, _Parser(), 1.0, 1.0, 1.0, lambda at: None, intake=intake, refuse=door)
        entered = gevent.spawn(wait.__enter__)
        wait_until(lambda: asked and (entered.dead or intake.waiting == 1))
        if judged is AtDoor.LIGHT:
            assert entered.dead and entered.value is wait and intake.waiting == 0
            wait.__exit__(None, None, None)
        else:
            assert not entered.dead  # in line for the next tick's token
            entered.kill()
        assert asked == [True]  # judged once, on arrival
