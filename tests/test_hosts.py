"""The system as separate hosts (network namespaces, harness/netns/), and cables pulled under load.

One harness per module (RabbitMQ in a namespace takes ~8 s to start): svc (RabbitMQ + Redis), api, api2,
batcher1, batcher2, gpu1, gpu2, each a namespace of its own on one bridge, the load sent from a client host.
Each test starts from the whole system (links up, every process running and serving) and checks, as callers
see it: nothing lost, nothing answered twice or with someone else's output, nobody waiting past deadline + 1 s
(harness/loadgen.py), except where a scenario says which callers may lose their connection.

Product settings are the shipped defaults (heartbeats every 1 s, stale after 3 s; AMQP heartbeat
LLMB_BROKER_HEARTBEAT_S 2 s; API lease 5 s), with 300 ms sim batches. Run with ``-s`` to see the measurements.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import pytest

from harness.loadgen import LATE_SLACK_S, LoadReport
from harness.netns.hosts import Hosts, unavailable
from harness.netns.scenarios import ApiCut, api_cut, batcher_cut, fairness, gpu_cut, outcome_counts

pytestmark = pytest.mark.fault

HOSTS = ("api", "api2", "batcher1", "batcher2", "gpu1", "gpu2")


class Settings(TypedDict):
    """The harness's settings, typed by key so that they unpack into Hosts' keywords."""
    sim_batch_ms: int
    log_level: str


SETTINGS: Settings = {"sim_batch_ms": 300, "log_level": "INFO"}
MAX_OUTSTANDING = 2  # LLMB_MAX_OUTSTANDING_BATCHES, the default


@pytest.fixture(scope="module")
def _harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    reason = unavailable()
    if reason:
        pytest.fail(f"network-namespace harness unavailable: {reason}")  # a missing service fails, never skips
    with Hosts(HOSTS, logs=Path(tmp_path_factory.mktemp("hosts")), **SETTINGS) as h:
        print(f"\n[hosts] up: network {h.timings.network_s:.1f} s, RabbitMQ {h.timings.rabbitmq_s:.1f} s, "
              f"processes {h.timings.processes_s:.1f} s; logs in {h.logs}", flush=True)
        yield h


@pytest.fixture
def h(_harness: Hosts) -> Iterator[Hosts]:
    """The module's hosts, whole again: links restored, missing processes started, serving."""
    _harness.whole()
    yield _harness
    _harness.restore_all()  # a failed test leaves no cable pulled


def show(name: str, report: LoadReport, **facts: object) -> None:
    extra = " ".join(f"{k}={v}" for k, v in facts.items())
    print(f"\n[{name}] {report.summary()}\n[{name}] {extra}", flush=True)


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def released(h: Hosts, within_s: float = 5.0) -> None:
    from harness.stack import wait_for

    try:
        wait_for(lambda: h.inflight() == 0, within_s, "the admission set to empty")
    except TimeoutError:
        raise AssertionError(f"{h.inflight()} admitted item(s) still hold capacity {within_s:g} s after the "
                             f"load stopped") from None


# -- a GPU host ----------------------------------------------------------------------------------------------
def test_cut_gpu_host_mid_load_its_batches_rerun_and_it_rejoins(h: Hosts) -> None:
    """gpu1's cable is pulled while it runs a batch: it leaves the pool at its stale heartbeat, its batches run
    on gpu2; when the cable is back its late results are harmless (callers answered once, with their own
    output) and it serves again."""
    r = gpu_cut(h, "gpu1")
    show("gpu host cut", r.report, left_pool_s=f"{r.left_pool_s:.1f}", rejoined_s=f"{r.rejoined_s:.1f}",
         ran_again_s=f"{r.ran_again_s:.1f}", taken_back=r.taken_back, skipped_on_waking=r.skipped_late,
         max_outstanding=r.outstanding, counts=outcome_counts(r.report, r.timeout_ms))
    r.report.assert_sound()
    assert r.taken_back, "no batcher logged taking the cut worker's batches back"
    assert r.left_pool_s < h.heartbeat_stale_s + 3, f"left the pool {r.left_pool_s:.1f} s after the cut"
    released(h)


# -- a batcher host --------------------------------------------------------------------------------------------
def test_cut_active_batcher_host_the_standby_takes_over(h: Hosts) -> None:
    """Two batchers, one active (single active consumer). Its cable is pulled: RabbitMQ closes its connection
    at the missed AMQP heartbeats and hands its unacknowledged requests, and all new ones, to the standby.
    Restored, it consumes again as the standby. Measured, not asserted: the most batches outstanding on one
    worker (3 seen for a moment: a batch the cut batcher still held, published when its cable came back, of
    requests the standby had already run; the worker drops items that already have an answer, so it does not
    run them again)."""
    r = batcher_cut(h)
    show("batcher host cut", r.report, active=r.active, standby=r.standby, heartbeat_s=r.heartbeat_s,
         switched_s=_s(r.switched_s), first_answer_s=_s(r.first_answer_s),
         worst_after_cut_ms=f"{r.worst_after_cut_ms:.0f}", rejoined_s=_s(r.rejoined_s), active_after=r.active_after,
         max_outstanding=r.outstanding, max_outstanding_at_s_after_cut=r.outstanding_at,
         counts=outcome_counts(r.report, r.timeout_ms))
    assert r.switched_s is not None, (
        f"RabbitMQ still counted the cut batcher {r.active}'s consumer 30 s after the cut (negotiated AMQP "
        f"heartbeat of its connections: {r.heartbeat_s} s)")
    bound = 3 * float(h.env.get("LLMB_BROKER_HEARTBEAT_S", 2.0)) + 2
    assert r.switched_s <= bound, f"the standby took over {r.switched_s:.1f} s after the cut (bound {bound:g} s)"
    r.report.assert_sound()
    assert r.active_after == r.standby, f"active after the cut: {r.active_after}, expected {r.standby}"
    assert r.rejoined_s is not None, f"{r.active} did not consume again within 45 s of its cable coming back"
    released(h)


# -- an API host ------------------------------------------------------------------------------------------------
def _cut_callers_sound(report: LoadReport, timeout_ms: int) -> None:
    """Callers of a cut API host: no wrong output; every HTTP answer a 200, a 503 unavailable (its process
    could not reach Redis while cut off) or a 429 overloaded (its calls still stuck on Redis when the cable came
    back hold their turns at admission, so the next ones could not get theirs in time: retry, on another host),
    in time; no answer at all (a timeout or a connection error) is expected of calls the cable cut."""
    assert report.wrong_output == 0, report.summary()
    assert report.sent == sum(report.statuses.values()), report.summary()
    assert set(report.statuses) <= {0, 200, 429, 503}, report.summary()
    assert set(report.error_types) <= {"unavailable", "overloaded"}, report.summary()
    assert report.non_json == 0, report.summary()
    late = [o for o in report.outcomes if o.status and o.latency_ms > timeout_ms + LATE_SLACK_S * 1000]
    assert not late, f"{len(late)} answered after deadline + 1 s\n{report.summary()}"


def _no_leak(r: ApiCut) -> None:
    """Nothing left admitted once every caller was answered. (A call whose admission reached Redis only when the
    cable was back, after its caller had been answered 503, used to be admitted and held until its deadline;
    the admission script now refuses a call that arrives later than its caller waits: AdmissionVerdict.LATE.)"""
    items = ", ".join(f"{i[:8]} ({left:g} s to its deadline, owner {(o or '-')[:8]})" for i, left, o in r.leftover)
    assert not r.inflight_after, f"{r.inflight_after} item(s) still admitted after every caller was answered: {items}"


def test_cut_the_only_api_host_releases_its_capacity(h: Hosts) -> None:
    """The one API host's cable is pulled with callers in flight (30 s deadlines). Its callers lose their
    connections or wait (expected); what it admitted must leave admission within seconds, not at the
    callers' deadlines (no other API process is left to reap its lapsed lease: a batcher does); with the cable
    back, new calls succeed."""
    h.signal("api2")  # the only API host for this test (the next test's fixture starts api2 again)
    r = api_cut(h, "api")
    show("only API host cut", r.report, held_at_cut=r.held_at_cut, released_s=_s(r.released_s),
         still_held=r.still_held, leftover=r.leftover,
         reaped_leases=r.reaped_instances, resumed_s=f"{r.resumed_s:.1f}", inflight_after=r.inflight_after,
         counts=outcome_counts(r.report, r.timeout_ms))
    _cut_callers_sound(r.report, r.timeout_ms)
    assert r.held_at_cut > 0, "nothing was in flight at the cut: the scenario tested nothing"
    _no_leak(r)
    lease = float(h.env.get("LLMB_API_LEASE_S", 5))
    assert r.released_s is not None, (
        f"{r.still_held} of the {r.held_at_cut} items the cut API host had admitted were still counted "
        f"{lease + 3:g} s after the cut: nobody reaped its lapsed lease (the batchers reap at every tick)")


def test_cut_an_api_host_beside_another_releases_its_capacity(h: Hosts) -> None:
    """api's cable is pulled while api2 serves too: api2's lease renewal reaps api's lapsed lease and releases
    what api had admitted within LLMB_API_LEASE_S (+ a renewal period); api2's callers are all served."""
    r = api_cut(h, "api", beside="api2")
    assert r.other is not None
    show("API host cut beside another", r.report, held_at_cut=r.held_at_cut, released_s=_s(r.released_s),
         still_held=r.still_held, leftover=r.leftover, reaped_leases=r.reaped_instances, resumed_s=f"{r.resumed_s:.1f}",
         inflight_after=r.inflight_after, counts=outcome_counts(r.report, r.timeout_ms),
         other=outcome_counts(r.other, 10_000))
    _cut_callers_sound(r.report, r.timeout_ms)
    r.other.assert_sound()
    assert r.held_at_cut > 0, "nothing of the cut host's was in flight at the cut: the scenario tested nothing"
    lease = float(h.env.get("LLMB_API_LEASE_S", 5))
    assert r.released_s is not None, (f"{r.still_held} of the {r.held_at_cut} items the cut host had admitted "
                                      f"still counted {lease + 3:g} s after the cut ({r.reaped_instances} "
                                      f"lease(s) reaped)")
    assert r.released_s <= lease + 3
    _no_leak(r)


# -- measurement: fairness with one and two batchers, batches outstanding per worker ----------------------------
def test_fairness_and_outstanding_batches_with_one_and_two_batchers(h: Hosts) -> None:
    """A steady tenant (10 req/s) beside another's flood (100 calls x 40 items at 25 calls/s: 1,000 items/s
    against ~660/s of capacity), once with one batcher and once with two (one active). Measured: the steady
    tenant's p50/p99 during the flood, and the most batches ever outstanding on one worker."""
    from harness.stack import wait_for

    standby = next(b for b in h.batcher_hosts if b != h.active_batcher())
    h.signal(standby)
    wait_for(lambda: h.queue(h.request_queue)[1] == 1, 30, "one batcher consuming")
    one = fairness(h)
    h.start(standby)
    wait_for(lambda: h.queue(h.request_queue)[1] == 2, 30, "two batchers consuming")
    two = fairness(h)
    for run in (one, two):
        show(f"fairness, {run.batchers} batcher(s)", run.steady,
             steady_p50_ms=f"{run.steady.p(50):.0f}", steady_p99_ms=f"{run.steady.p(99):.0f}",
             flood=outcome_counts(run.flood, 15_000), flood_items=run.flood_items, flood_s=f"{run.flood_s:.1f}",
             max_outstanding=run.outstanding, max_ready_in_queue=run.max_ready)
        run.steady_all.assert_sound()
        run.flood.assert_sound(allow={200, 429})
    assert max(two.outstanding.values(), default=0) <= MAX_OUTSTANDING, (
        f"with two batchers a worker held more than {MAX_OUTSTANDING} batches: {two.outstanding}")
