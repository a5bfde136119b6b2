"""Routing decisions, as a pure object with an explicit clock."""
from __future__ import annotations

import pytest

from tasks.policy.scheduler import Scheduler
from tasks.schema import WorkerInfo


def worker(wid: str, model: str = "sim", batch_ms: float = 250.0) -> WorkerInfo:
    return WorkerInfo(id=wid, queue=f"q.{wid}", model=model, max_batch=100, state="idle", outstanding=0,
                      completed=0, batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)


def test_no_worker_means_no_choice_and_no_retry_time() -> None:
    choice = Scheduler().choose([], "sim", now=0.0)
    assert choice.worker is None and choice.retry_in_s is None


def test_only_workers_serving_the_model_are_candidates() -> None:
    s = Scheduler()
    assert s.choose([worker("a", model="embed")], "sim", now=0.0).worker is None
    assert s.choose([worker("a", model="embed"), worker("b")], "sim", now=0.0).worker.id == "b"  # type: ignore[union-attr]


def test_idle_worker_beats_busy_one_not_round_robin() -> None:
    s = Scheduler(max_outstanding=2)
    a, b = worker("a"), worker("b")
    s.sent("a", "a1", now=0.0)
    s.started("a", "a1", now=0.0)
    for t in (0.1, 0.2, 0.3):
        assert s.choose([a, b], "sim", now=t).worker is b


def test_next_batch_waits_until_the_running_one_is_nearly_done() -> None:
    s = Scheduler(max_outstanding=2, lead_s=0.015)
    a = worker("a", batch_ms=250)
    s.sent("a", "1", now=0.0)
    s.started("a", "1", now=0.0)
    choice = s.choose([a], "sim", now=0.100)
    assert choice.worker is None
    assert choice.retry_in_s == pytest.approx(0.250 - 0.100 - 0.015)
    assert s.choose([a], "sim", now=0.236).worker is a  # 14 ms left: hand the next batch over now


def test_at_most_max_outstanding_batches_then_wait_for_an_event() -> None:
    s = Scheduler(max_outstanding=2)
    a = worker("a", batch_ms=0.0)  # no estimate yet: only the count limits
    s.sent("a", "x", now=0.0)
    s.sent("a", "y", now=0.0)
    choice = s.choose([a], "sim", now=1.0)
    assert choice.worker is None and choice.retry_in_s is None
    assert s.finished("a", "x", run_s=0.2)
    assert s.choose([a], "sim", now=1.0).worker is None  # y not started: estimated 0.2 s of backlog
    s.started("a", "y", now=1.0)
    assert s.choose([a], "sim", now=1.19).worker is a


def test_measured_batch_time_replaces_the_heartbeat_figure() -> None:
    s = Scheduler()
    a = worker("a", batch_ms=1000)
    assert s.batch_s(a) == 1.0
    s.sent("a", "1", now=0)
    s.finished("a", "1", run_s=0.5)
    assert s.batch_s(a) == 0.5


def test_a_faster_worker_gets_proportionally_more_batches() -> None:
    """Simulate two workers, one twice as fast, fed back to back for 60 s of virtual time."""
    s = Scheduler(max_outstanding=2, lead_s=0.0)
    fast, slow = worker("fast", batch_ms=250), worker("slow", batch_ms=500)
    speed = {"fast": 0.25, "slow": 0.5}
    running: dict[str, tuple[str, float]] = {}
    queued: dict[str, list[str]] = {"fast": [], "slow": []}
    counts = {"fast": 0, "slow": 0}
    now, n = 0.0, 0
    while now < 60:
        for wid in ("fast", "slow"):  # advance each device
            if wid in running and running[wid][1] <= now:
                s.finished(wid, running.pop(wid)[0], speed[wid])
            if wid not in running and queued[wid]:
                batch = queued[wid].pop(0)
                s.started(wid, batch, now)
                running[wid] = (batch, now + speed[wid])
        choice = s.choose([fast, slow], "sim", now)
        if choice.worker is not None:
            n += 1
            s.sent(choice.worker.id, str(n), now)
            queued[choice.worker.id].append(str(n))
            counts[choice.worker.id] += 1
        now += 0.005
    assert counts["fast"] == pytest.approx(2 * counts["slow"], rel=0.1)


def test_lost_announcements_are_forgotten() -> None:
    s = Scheduler(max_outstanding=1, forget_after_s=30.0)
    a = worker("a", batch_ms=0)
    assert not s.finished("a", "never-sent")
    s.sent("a", "lost", now=0.0)
    assert s.choose([a], "sim", now=10.0).worker is None
    assert s.choose([a], "sim", now=31.0).worker is a


def test_ties_go_to_the_worker_sent_to_least_recently() -> None:
    s = Scheduler()
    a, b = worker("a"), worker("b")
    s.sent("a", "1", now=1.0)
    s.finished("a", "1")
    assert s.choose([a, b], "sim", now=2.0).worker is b


def test_a_lost_finished_announcement_is_repaired_by_the_workers_heartbeat() -> None:
    """A broker cut can drop 'finished' announcements; the worker's idle heartbeat frees its slots again."""
    from dataclasses import replace

    s = Scheduler(max_outstanding=2)
    a = worker("a")
    s.sent("a", "a1", now=10.0)
    s.sent("a", "a2", now=10.1)
    assert s.choose([a], "sim", now=11.0).worker is None  # at its limit, as far as the scheduler knows
    s.reconcile([replace(a, state="busy", outstanding=2, heartbeat_at=1012.0)], wall_to_mono=-1000.0)
    assert s.outstanding("a", 12.0) == 2  # busy: the heartbeat proves nothing
    s.reconcile([replace(a, heartbeat_at=1010.5)], wall_to_mono=-1000.0)
    assert s.outstanding("a", 12.0) == 2  # idle, but too soon after the sends to be sure (clocks differ)
    s.reconcile([replace(a, heartbeat_at=1012.0)], wall_to_mono=-1000.0)
    assert s.outstanding("a", 12.0) == 0
    assert s.choose([a], "sim", now=12.0).worker is not None


def kv_worker(wid: str, kv_tokens: int, slots: int = 4) -> WorkerInfo:
    from dataclasses import replace

    return replace(worker(wid, model="lm"), kv_tokens=kv_tokens, slots=slots)


def test_a_worker_whose_kv_cache_is_spoken_for_takes_nothing_more() -> None:
    s = Scheduler(max_outstanding=2)
    w = kv_worker("a", kv_tokens=1000)
    first = s.choose([w], "lm", now=0.0)
    assert first.worker is w and first.kv_room == 1000
    s.sent("a", "b1", now=0.0, tokens=800)
    assert s.choose([w], "lm", now=0.0).kv_room == 200  # the next batch may hold 200 tokens more
    s.sent("a", "b2", now=0.0, tokens=200)
    full = s.choose([w], "lm", now=0.0)
    assert full.worker is None and full.retry_in_s is None  # until a batch finishes
    s.finished("a", "b1", 0.5)
    assert s.choose([w], "lm", now=0.5).kv_room == 800


def test_equal_backlogs_go_to_the_worker_with_the_most_kv_room() -> None:
    s = Scheduler(max_outstanding=2)
    a, b = kv_worker("a", kv_tokens=10_000), kv_worker("b", kv_tokens=10_000)
    s.sent("a", "a1", now=0.0, tokens=6000)
    s.sent("b", "b1", now=0.0, tokens=1000)
    choice = s.choose([a, b], "lm", now=0.0)
    assert choice.worker is b and choice.kv_room == 9000


def _hand_over(s: Scheduler, n: int, idle_s: float) -> None:
    """Batch ``n`` ran; batch ``n + 1``, sent while it ran, started after the device had sat free ``idle_s``."""
    s.sent("a", str(n + 1), now=n + 0.5)
    s.finished("a", str(n), run_s=0.25)
    s.started("a", str(n + 1), now=n + 1.0, idle_s=idle_s)


def test_late_hand_overs_lengthen_the_lead_and_timely_ones_shorten_it() -> None:
    s = Scheduler(lead_s=0.015, lead_step_s=0.005, late_share=0.1)
    a = worker("a", batch_ms=250)
    s.sent("a", "0", now=0.0)
    s.started("a", "0", now=0.0)
    for n in range(4):  # the device sat free 20 ms before each batch came: the batcher runs late here
        _hand_over(s, n, idle_s=0.020)
    assert s.lead(a) == pytest.approx(0.015 + 4 * 0.0045)
    for n in range(4, 8):  # each came while the device was busy: on time
        _hand_over(s, n, idle_s=0.0)
    assert s.lead(a) == pytest.approx(0.015 + 4 * 0.0045 - 4 * 0.0005)
    for n in range(8, 200):  # always on time: down to the floor, never below
        _hand_over(s, n, idle_s=0.0)
    assert s.lead(a) == pytest.approx(0.002)


def test_the_learnt_lead_stays_within_a_quarter_of_the_batch() -> None:
    s = Scheduler(lead_s=0.015)
    a = worker("a", batch_ms=40)
    s.sent("a", "0", now=0.0)
    s.started("a", "0", now=0.0)
    for n in range(100):
        s.sent("a", str(n + 1), now=n + 0.5)
        s.finished("a", str(n), run_s=0.04)
        s.started("a", str(n + 1), now=n + 1.0, idle_s=0.5)
    assert s.lead(a) == pytest.approx(0.010)


def test_only_a_batch_sent_while_the_worker_was_busy_times_the_hand_over() -> None:
    s = Scheduler(lead_s=0.015)
    a = worker("a", batch_ms=250)
    s.sent("a", "1", now=0.0)  # the worker was idle: the device waited for items, not for the batcher
    s.started("a", "1", now=0.0, idle_s=3.0)
    s.finished("a", "1", run_s=0.25)
    s.sent("a", "2", now=1.0)
    s.started("a", "2", now=1.0, idle_s=0.7)
    assert s.lead(a) == pytest.approx(0.015)
    s.started("a", "2", now=1.0, idle_s=None)  # an older worker measures nothing
    assert s.lead(a) == pytest.approx(0.015)
