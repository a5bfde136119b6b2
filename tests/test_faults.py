"""Fault injection under steady load: every process type killed (SIGKILL) or stopped (SIGTERM) mid-flight.

The real system (gunicorn with 2 processes, the batcher, 2 sim workers under their supervisors) runs at a
steady open-loop load (harness/loadgen.py) while one process is signalled. Each test then checks the
design's invariants (docs/design.md, "Failure behaviour") as a caller sees them:

- every request gets exactly one answer: its own output (200) or a clear JSON error; nobody waits past
  deadline + 1 s; no output reaches the wrong caller;
- the process survives or is restarted, and the service resumes by itself (a request afterwards gets 200);
- the admission capacity of answered (or abandoned) requests is released.

Heartbeats every 250 ms, stale after 1 s, so a lost worker is noticed fast. Each test prints its LoadReport
summary (`pytest -s` or `-rP` shows it).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.helpers import assert_json_error, expected, post
from harness.loadgen import LoadReport, SteadyLoad, carry_on, warm
from harness.stack import Stack, alive, running_stack, wait_for

pytestmark = pytest.mark.fault

POISON = "__poison__"
RATE = 40.0  # requests/s: well inside two 300 ms sim workers' capacity (~650/s), modest for 2 shared cores
TIMEOUT_MS = 10_000
SIM_BATCH_MS = 300
SETTINGS = dict(sim_batch_ms=SIM_BATCH_MS, heartbeat_interval_s=0.25, heartbeat_stale_factor=4, sim_raise_on=POISON,
                log_level="INFO")
Steady = Callable[..., SteadyLoad]


# -- the system ----------------------------------------------------------------------------------------
@contextmanager
def started(tmp: Path, workers: int = 2, **env: object) -> Iterator[Stack]:
    """The stack these tests run: ``workers`` sim workers, the batcher, gunicorn with 2 processes, all serving."""
    with running_stack(tmp, workers=tuple(range(workers)), web_workers=2, ready=False,
                       settings={**SETTINGS, **env}) as s:
        whole(s, workers)
        yield s


def whole(s: Stack, workers: int = 2) -> None:
    """Wait until every process of the stack runs and serves."""
    s.wait_serving(workers=workers, web_workers=2)


def restore(s: Stack) -> None:
    """Start again whatever a test stopped (as an operator or an init system would), then wait until whole."""
    s.restart_missing(workers=2, web_workers=2)
    whole(s)


_shared: dict[str, Stack] = {}
_running = ExitStack()  # stops the shared stack now in _shared


def share(tmp: Path) -> None:
    """Stop the shared stack (if there is one) and start a fresh one in its place."""
    _running.close()
    _shared["stack"] = _running.enter_context(started(tmp))


@pytest.fixture(scope="module")
def _module_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    try:
        share(Path(tmp_path_factory.mktemp("faults")))
        yield _shared
    finally:
        _running.close()
        _shared.pop("stack", None)


@pytest.fixture
def stack(_module_stack: dict[str, Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """The shared stack, whole again (or rebuilt when a previous test left it beyond repair)."""
    try:
        restore(_module_stack["stack"])
    except Exception:
        share(Path(tmp_path_factory.mktemp("faults")))
    return _module_stack["stack"]


OwnStack = Callable[..., Stack]


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[OwnStack]:
    """A stack for one test only: ``own_stack(**settings)`` starts it with its own settings; it is stopped after
    the test (and after the test's load)."""
    with ExitStack() as stacks:
        yield lambda **env: stacks.enter_context(started(tmp_path, **env))


# -- the load ------------------------------------------------------------------------------------------
@pytest.fixture
def steady() -> Iterator[Steady]:
    """Starts a SteadyLoad; one a failed test left running is stopped (and drained) before the next test."""
    loads: list[SteadyLoad] = []

    def begin(url: str, rate: float = RATE, **kwargs: Any) -> SteadyLoad:
        load = SteadyLoad(url, rate, **kwargs)
        loads.append(load)
        return load.start()

    yield begin
    for load in loads:
        if not load.stopped:
            load.stop()


def resumed(s: Stack) -> None:
    """The service answers a new request with its own output, by itself."""
    text = f"after {uuid.uuid4().hex}"
    r = post(s.url, {"input": text, "timeout_ms": TIMEOUT_MS}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["output"] == expected(text)


def released(s: Stack, within_s: float = 5.0) -> None:
    """Admission capacity held by requests that were answered (or whose caller is gone) comes back."""
    try:
        wait_for(lambda: s.inflight() == 0, within_s, "the admission set to empty")
    except TimeoutError:
        raise AssertionError(f"{s.inflight()} admitted item(s) still hold capacity {within_s:g} s after the "
                             f"load stopped") from None


def show(name: str, report: LoadReport) -> None:
    print(f"\n[{name}] {report.summary()}", flush=True)


def wait_busy(s: Stack, device: int, timeout_s: float = 15) -> None:
    wait_for(lambda: s.fleet().get(f"gpu{device}@test", {}).get("state") == "busy", timeout_s,
             f"gpu{device} running a batch")


def early_in_a_batch(s: Stack, device: int) -> None:
    """Signal time: ``gpu<device>`` is in the first half of a batch, before the batcher hands it the next one
    (LLMB_DISPATCH_LEAD_MS before this one ends), so a graceful stop must also give back a batch that arrives
    while it is stopping."""
    s.wait_batch_start(device, within_s=SIM_BATCH_MS / 2000)


# -- API processes -------------------------------------------------------------------------------------
def test_sigkill_of_an_api_worker_process_releases_what_its_callers_held(own_stack: OwnStack, steady: Steady) -> None:
    """Callers on the killed process lose their connection (allowed, counted); everyone else is served, and
    the admission capacity the dead process's callers held is released at once, not at their deadlines."""
    s = own_stack()
    load = steady(s.url, timeout_ms=60_000, prefix="api-kill")
    warm(load)
    victim = s.web_workers()[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in s.web_workers() and len(s.web_workers()) == 2, 20,
             "gunicorn to replace its killed worker")
    carry_on(load)
    report = load.stop()
    show("api worker SIGKILL", report)
    report.assert_sound(max_no_answer=int(RATE))  # at most those in flight on the killed process
    assert set(report.no_answer_kinds) <= {"reset"}, report.summary()
    resumed(s)
    released(s)


def test_sigterm_of_an_api_worker_process_serves_its_callers(steady: Steady, stack: Stack) -> None:
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix="api-term")
    warm(load)
    victim = stack.web_workers()[0]
    os.kill(victim, signal.SIGTERM)
    wait_for(lambda: victim not in stack.web_workers() and len(stack.web_workers()) == 2, 20,
             "gunicorn to replace its stopped worker")
    carry_on(load)
    report = load.stop()
    show("api worker SIGTERM", report)
    report.assert_sound()
    resumed(stack)
    released(stack)


def test_sigterm_of_gunicorn_completes_what_it_admitted_and_a_new_one_takes_over(steady: Steady, stack: Stack) -> None:
    """A graceful stop of the whole API server: everything it had accepted is answered 200; callers arriving
    while no server listens are refused at connect (never admitted); a new server then serves everyone."""
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix="api-stop")
    warm(load)
    stopped_at = time.monotonic()
    stack.signal("web", signal.SIGTERM)
    rc = stack.wait_exit("web", timeout_s=30)
    load.retarget(stack.start_web(workers=2))  # the replacement; the load balancer moves over
    moved_at = time.monotonic() + 0.05  # requests sent from here on went to the new server
    carry_on(load)
    report = load.stop()
    show("gunicorn SIGTERM", report)
    assert rc == 0, f"gunicorn exited {rc} on SIGTERM"
    before = [o for o in report.outcomes if o.sent_at < stopped_at - 0.05]
    assert all(o.status == 200 for o in before), (
        f"requests in flight at SIGTERM not answered 200: "
        f"{[(o.status, o.error_type or o.no_answer) for o in before if o.status != 200]}\n{report.summary()}")
    assert set(report.no_answer_kinds) <= {"refused", "reset"}, report.summary()
    # the only callers without an answer are those that came while no server listened (never admitted)
    gap = {o.seq for o in report.outcomes if stopped_at - 0.05 <= o.sent_at < moved_at}
    outside = [o for o in report.outcomes if o.status == 0 and o.seq not in gap]
    assert not outside, (f"callers without an answer outside the gap between the servers: "
                         f"{[(round(o.sent_at - stopped_at, 2), o.no_answer) for o in outside]}\n{report.summary()}")
    report.assert_sound(max_no_answer=len(gap))
    resumed(stack)
    released(stack)


# -- the batcher ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_batcher_killed_or_stopped_and_restarted_loses_nothing(steady: Steady, stack: Stack, sig: int) -> None:
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix=f"batcher-{sig}")
    warm(load)
    stack.kill("batcher", sig)  # waits for it to end (SIGKILL after 30 s if SIGTERM did not stop it)
    stack.start_batcher()
    carry_on(load, 3.0)
    report = load.stop()
    show(f"batcher {signal.Signals(sig).name}", report)
    report.assert_sound()
    resumed(stack)
    released(stack)


def test_the_active_batcher_killed_its_standby_takes_over_without_a_restart(steady: Steady, stack: Stack) -> None:
    """Two batchers: RabbitMQ delivers to one (single active consumer). A batcher that joins under load becomes
    the standby without disturbing anything in flight; SIGKILL the active one and the standby gets its
    unacknowledged requests and every new one, with nothing restarted."""
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix="failover")
    warm(load)
    stack.start_batcher("standby")
    wait_for(lambda: stack.request_queue_consumers() == 2, 30, "the standby batcher consuming")
    killed_at = time.monotonic()
    stack.kill("batcher", signal.SIGKILL)
    carry_on(load, 3.0)
    report = load.stop()
    show(f"active batcher SIGKILL, standby took over ({time.monotonic() - killed_at:.1f} s)", report)
    report.assert_sound()
    resumed(stack)
    released(stack)
    assert stack.procs["standby"].poll() is None
    stack.kill("standby", signal.SIGTERM)
    stack.start_batcher()  # the shared stack as the next test expects it


# -- GPU workers ---------------------------------------------------------------------------------------
def test_sigkill_of_a_whole_worker_host_loses_nothing(steady: Steady, stack: Stack) -> None:
    """The supervisor and its worker killed at once, mid-batch, like a lost host."""
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix="host-kill")
    warm(load)
    wait_busy(stack, 0)
    stack.kill("gpu0", signal.SIGKILL)
    wait_for(lambda: "gpu0@test" not in stack.fleet(), 10, "the lost worker to leave the fleet view")
    carry_on(load)
    report = load.stop()
    show("worker host SIGKILL", report)
    report.assert_sound()
    resumed(stack)
    released(stack)


@pytest.mark.parametrize("group", [False, True], ids=["supervisor", "process-group"])
def test_sigterm_of_a_worker_is_a_graceful_stop(steady: Steady, stack: Stack, group: bool) -> None:
    """A scale-down or rollout: the supervisor is told to stop (or, as systemd and `docker stop` of a process
    tree do, every process of the group at once, so the worker hears SIGTERM twice); its worker hands back
    everything it holds and leaves, and every caller is answered 200 by the other worker."""
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix="worker-term")
    warm(load)
    early_in_a_batch(stack, 0)
    child = stack.worker_child(0)
    stack.signal("gpu0", signal.SIGTERM, group=group)
    rc = stack.wait_exit("gpu0", timeout_s=30)
    carry_on(load)
    report = load.stop()
    show(f"worker SIGTERM ({'process group' if group else 'supervisor'})", report)
    report.assert_sound()
    assert not alive(child), "the worker process outlived its supervisor's graceful stop"
    assert rc == 0, f"the supervisor exited {rc} on SIGTERM"
    assert "gpu0@test" not in stack.fleet(), "a stopped worker leaves the fleet view"
    resumed(stack)
    released(stack)


def test_sigkill_of_the_worker_process_only_is_restarted_by_its_supervisor(steady: Steady, stack: Stack) -> None:
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix="child-kill")
    warm(load)
    wait_busy(stack, 0)
    child = stack.worker_child(0)
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: (stack.children("gpu0") or [child])[-1] != child, 10,
             "the supervisor to start a new worker process")

    def beating() -> bool:
        beat = stack.fleet().get("gpu0@test", {})
        return beat.get("state") in ("idle", "busy") and time.time() - float(beat["heartbeat_at"]) < 1

    wait_for(beating, 30, "the restarted worker's heartbeat")
    carry_on(load)
    report = load.stop()
    show("worker child SIGKILL", report)
    report.assert_sound()
    assert stack.procs["gpu0"].poll() is None, "the supervisor survives its worker"
    resumed(stack)
    released(stack)


def test_sigkill_of_a_supervisor_only_does_not_leave_its_worker_orphaned(steady: Steady, stack: Stack) -> None:
    """The supervisor dies alone: its worker must not serve on without a supervisor; it notices, hands its
    batches back and stops. The other worker serves every caller."""
    load = steady(stack.url, timeout_ms=TIMEOUT_MS, prefix="sup-kill")
    orphan = stack.worker_child(0)
    try:
        warm(load)
        early_in_a_batch(stack, 0)
        stack.signal("gpu0", signal.SIGKILL)
        stack.wait_exit("gpu0", timeout_s=10)
        stopped = True
        try:
            wait_for(lambda: not alive(orphan), 15, "the orphaned worker to stop")
        except TimeoutError:
            stopped = False
        carry_on(load)
        report = load.stop()
        show("worker supervisor SIGKILL", report)
        report.assert_sound()
        assert stopped, "the worker process still runs 15 s after its supervisor was killed (orphaned)"
        wait_for(lambda: "gpu0@test" not in stack.fleet(), 5, "the orphan's entry to leave the fleet view")
        resumed(stack)
        released(stack)
    finally:
        if alive(orphan):
            os.kill(orphan, signal.SIGKILL)


# -- one batch, one request ----------------------------------------------------------------------------
def test_a_lone_batch_whose_worker_dies_is_rerun_not_quarantined(own_stack: OwnStack) -> None:
    """One request, nothing else: its worker is SIGKILLed (process group, a lost host) while running it. A
    death is not a verdict: the request is re-run by the other worker (200), and its input not quarantined."""
    s = own_stack(sim_batch_ms=2000)
    text = f"lone {uuid.uuid4().hex}"
    answer: list[requests.Response | BaseException] = []

    def call() -> None:
        try:
            answer.append(post(s.url, {"input": text, "timeout_ms": 20_000}, timeout=30))
        except BaseException as exc:
            answer.append(exc)

    sent_at = time.time()
    caller = threading.Thread(target=call)
    caller.start()
    found: list[int] = []

    def busy() -> bool:  # busy with a batch started after the call (not the end of the start-up probe's)
        found[:] = [int(w.split("@")[0][3:]) for w, hb in s.fleet().items()
                    if hb["state"] == "busy" and float(hb.get("batch_started_at") or 0) >= sent_at]
        return bool(found)

    wait_for(busy, 15, "the worker running the lone batch")
    s.kill(f"gpu{found[0]}", signal.SIGKILL)
    caller.join(timeout=40)
    assert answer, "no answer within 40 s"
    r = answer[0]
    assert isinstance(r, requests.Response), r
    print(f"\n[lone batch killed] {r.status_code} {r.text[:200]}", flush=True)
    assert r.status_code == 200, f"a lone batch whose worker died was answered {r.status_code}: {r.text}"
    assert r.json()["output"] == expected(text)
    listing = json.loads(s.admin("quarantine", "list", "--json").stdout)
    assert listing == [], f"an input whose worker died was quarantined: {listing}"


# -- a poison input under load -------------------------------------------------------------------------
def test_one_poison_input_per_thousand_fails_alone_under_load(steady: Steady, stack: Stack) -> None:
    every, total, rate = 1000, 2000, 80.0

    def body(seq: int) -> dict[str, object]:
        marker = f" {POISON}" if seq % every == every - 1 else ""
        return {"input": f"poison-load {seq}{marker} {uuid.uuid4().hex}", "timeout_ms": 15_000}

    load = steady(stack.url, rate, body=body, max_workers=160)
    wait_for(lambda: load.sent >= total, total / rate + 30, f"{total} requests sent")
    report = load.stop()
    show("poison 1 in 1000", report)
    poisoned = {o.seq for o in report.outcomes if o.seq % every == every - 1}
    refused = {o.seq for o in report.outcomes if o.status == 422 and o.error_type == "poison_input"}
    assert refused == poisoned, f"422 poison_input for {sorted(refused)}, poison sent as {sorted(poisoned)}\n" \
                                f"{report.summary()}"
    report.assert_sound(allow={200, 422})
    assert report.statuses[422] == len(poisoned), report.summary()
    r = post(stack.url, {"input": "healthy after poison", "timeout_ms": TIMEOUT_MS})
    assert r.status_code == 200 and r.json()["output"] == expected("healthy after poison")
    again = post(stack.url, {"input": f"poison-load 999 {POISON} again", "timeout_ms": TIMEOUT_MS})
    assert_json_error(again, 422, "poison_input")
    released(stack)
