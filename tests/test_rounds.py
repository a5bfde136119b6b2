"""Rounds at the door, with threads: calls that arrive while a round is in flight go together in the next one."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from harness.stack import wait_for
from tasks.gateway.rounds import Rounds


class Door:
    """A round function that holds each round until the test lets it go, and records what each carried."""

    def __init__(self) -> None:
        self.carried: list[list[int]] = []
        self.release = threading.Semaphore(0)
        self.started = threading.Semaphore(0)

    def run(self, entries: Sequence[int], hand_on: Callable[[], None]) -> list[int | Exception]:
        self.carried.append(list(entries))
        self.started.release()
        self.release.acquire()
        return [ValueError(f"odd {e}") if e % 2 else e * 10 for e in entries]


def join_all(rounds: Rounds[int, int], pool: ThreadPoolExecutor, entries: range) -> list[Future[int]]:
    """Join each entry from its own thread while a round is in flight, one after the other: each is seated
    before the next is sent (threads started together take their seats in whatever order they run)."""
    futures = []
    for e in entries:
        seated = len(rounds) + 1
        futures.append(pool.submit(rounds.join, e))
        wait_for(lambda seated=seated: len(rounds) == seated, 5, f"call {e} seated")
    return futures


def test_calls_arriving_during_a_round_go_together_in_the_next_each_with_its_own_outcome() -> None:
    door = Door()
    rounds: Rounds[int, int] = Rounds(door.run, max_size=4, abandoned=lambda: RuntimeError("abandoned"))
    with ThreadPoolExecutor(max_workers=8) as pool:
        first = pool.submit(rounds.join, 0)
        assert door.started.acquire(timeout=5)  # a lone call goes at once, in a round of its own
        later = join_all(rounds, pool, range(1, 7))
        wait_for(lambda: len(rounds) == 6, 5, "six calls waiting for the round in flight")
        for _ in range(3):
            door.release.release()
        assert first.result(timeout=5) == 0
        wait_for(lambda: len(door.carried) == 3, 5, "the two rounds after the first")
        for future, entry in zip(later, range(1, 7)):
            if entry % 2:
                with pytest.raises(ValueError, match=f"odd {entry}"):
                    future.result(timeout=5)
            else:
                assert future.result(timeout=5) == entry * 10
    assert door.carried == [[0], [1, 2, 3, 4], [5, 6]]  # at most max_size a round, in arrival order
    assert not rounds._busy and not len(rounds)


def test_entries_picked_first_go_ahead_of_the_others_waiting_in_arrival_order() -> None:
    """A light tenant's calls (``first``) take the next round's first seats, ahead of a flood's calls that
    arrived before them; the others keep their order behind."""
    door = Door()
    rounds: Rounds[int, int] = Rounds(door.run, max_size=3, abandoned=lambda: RuntimeError("abandoned"),
                                      first=lambda entry: entry >= 100)
    with ThreadPoolExecutor(max_workers=8) as pool:
        first = pool.submit(rounds.join, 0)
        assert door.started.acquire(timeout=5)
        later = join_all(rounds, pool, range(2, 8, 2))
        light = join_all(rounds, pool, range(100, 104, 2))
        for _ in range(3):
            door.release.release()
        assert first.result(timeout=5) == 0
        assert [f.result(timeout=5) for f in later + light] == [20, 40, 60, 1000, 1020]
    assert door.carried == [[0], [100, 102, 2], [4, 6]]
    assert not rounds._busy and not len(rounds)


def test_a_round_that_raises_fails_its_calls_and_the_next_round_still_runs() -> None:
    calls: list[list[int]] = []

    def run(entries: Sequence[int], hand_on: Callable[[], None]) -> list[int | Exception]:
        calls.append(list(entries))
        if 0 in entries:
            raise ConnectionError("Redis went away")
        return list(entries)

    rounds: Rounds[int, int] = Rounds(run, max_size=10, abandoned=lambda: RuntimeError("abandoned"))
    with pytest.raises(ConnectionError):
        rounds.join(0)
    assert rounds.join(7) == 7
    assert calls == [[0], [7]]


def test_an_interrupted_leader_leaves_the_others_of_its_round_an_error_and_hands_on() -> None:
    """A leader interrupted in the middle of its round (a killed greenlet: a BaseException) must not leave its
    round's callers waiting forever, nor the door marked busy."""
    first_round = threading.Event()
    in_first = threading.Event()

    def run(entries: Sequence[int], hand_on: Callable[[], None]) -> list[int | Exception]:
        if 9 in entries:  # the round in flight while 0 and 1 arrive
            in_first.set()
            first_round.wait(5)
        if 0 in entries:
            raise KeyboardInterrupt  # what a killed greenlet's GreenletExit is to this code: not an Exception
        return list(entries)

    rounds: Rounds[int, int] = Rounds(run, max_size=10, abandoned=lambda: RuntimeError("round abandoned"))
    interrupted: list[BaseException] = []

    def join_interrupted(entry: int) -> None:
        try:
            rounds.join(entry)
        except KeyboardInterrupt as exc:
            interrupted.append(exc)

    with ThreadPoolExecutor(max_workers=3) as pool:
        in_flight = pool.submit(rounds.join, 9)
        assert in_first.wait(5)
        leader = pool.submit(join_interrupted, 0)  # the first waiting: it leads the next round
        wait_for(lambda: len(rounds) == 1, 5, "0 waiting for the round in flight")
        follower = pool.submit(rounds.join, 1)
        wait_for(lambda: len(rounds) == 2, 5, "1 waiting behind it")
        first_round.set()
        assert in_flight.result(timeout=5) == 9
        leader.result(timeout=5)
        with pytest.raises(RuntimeError, match="round abandoned"):
            follower.result(timeout=5)
    assert len(interrupted) == 1
    assert rounds.join(2) == 2 and not rounds._busy


def test_a_round_that_hands_on_lets_the_next_round_run_while_it_still_waits() -> None:
    """The door's round hands on once only the broker's confirm is left: a round blocked on it (a broker alarm)
    must not hold the rounds behind it."""
    confirm = threading.Event()
    carried: list[list[int]] = []

    def run(entries: Sequence[int], hand_on: Callable[[], None]) -> list[int | Exception]:
        carried.append(list(entries))
        hand_on()
        if 0 in entries:
            assert confirm.wait(5)
        return list(entries)

    rounds: Rounds[int, int] = Rounds(run, max_size=10, abandoned=lambda: RuntimeError("abandoned"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        blocked = pool.submit(rounds.join, 0)
        wait_for(lambda: carried == [[0]], 5, "the first round, waiting for its confirm")
        assert pool.submit(rounds.join, 1).result(timeout=5) == 1  # ran while the first still waits
        assert not blocked.done()
        confirm.set()
        assert blocked.result(timeout=5) == 0
    assert not rounds._busy
