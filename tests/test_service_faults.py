"""The backbone failing under load: Redis killed, broker connections cut, a broker alarm, a connection flood.

Each test runs the real processes under a steady open-loop load (harness/loadgen.py), breaks one service
while it runs, and checks invariant 1 for every request sent: exactly one answer (its own output or a clear JSON
error), never later than its deadline + 1 s, no connection reset; and that the service comes back by itself.
Nothing shared is disturbed: Redis is a private server, connections are cut in a vhost of the test's own, the
alarm is raised on a private RabbitMQ node (harness/services.py).
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import resource
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests

from harness.helpers import expected
from harness.loadgen import LATE_SLACK_S, LoadReport, Outcome, SteadyLoad
from harness.stack import Stack, running_stack, wait_for
from harness.stats import percentile

if TYPE_CHECKING:  # the fixtures come from harness.services, a plugin of conftest.py
    from harness.services import PrivateRabbit, PrivateRedis, Vhost

pytestmark = pytest.mark.fault


# -- helpers --------------------------------------------------------------------------------------------------------
def probe(url: str, timeout_ms: int = 8000) -> tuple[int, str | None, float]:
    """One request of the test's own: (status, error type, seconds); status 0 when no HTTP answer."""
    text = f"probe {uuid.uuid4().hex}"
    started = time.monotonic()
    try:
        r = requests.post(url + "/v1/infer", json={"input": text, "timeout_ms": timeout_ms},
                          timeout=timeout_ms / 1000 + 5)
    except requests.RequestException:
        return 0, None, time.monotonic() - started
    elapsed = time.monotonic() - started
    if r.status_code == 200:
        assert r.json()["output"] == expected(text), "a probe got someone else's output"
        return 200, None, elapsed
    try:
        return r.status_code, r.json()["error"]["type"], elapsed
    except (ValueError, KeyError, TypeError):
        return r.status_code, "non-json", elapsed


def wait_status(url: str, status: int, timeout_s: float, what: str, timeout_ms: int = 8000) -> tuple[float, str]:
    """Probe until one answer has ``status``; returns (when, monotonic; that probe's latency and type)."""
    seen: list[tuple[int, str | None, float]] = []

    def check() -> bool:
        seen.append(probe(url, timeout_ms))
        return seen[-1][0] == status

    wait_for(check, timeout_s, f"{what} (probes so far: {[(s, t, round(e, 2)) for s, t, e in seen[-8:]]})")
    return time.monotonic(), f"{seen[-1][1]} in {seen[-1][2] * 1000:.0f} ms after {len(seen)} probe(s)"


def hold(load: SteadyLoad, mark: int, seconds: float) -> None:
    """Keep the load (and whatever fault is on) going until ``seconds`` of its arrivals have been sent after its
    ``mark``-th request: a count of requests sent, not a sleep (as carry_on in harness/loadgen.py)."""
    want = mark + int(seconds * load.rate)
    wait_for(lambda: load.sent >= want, seconds + 30, f"{want} requests sent ({seconds:g} s of arrivals)")


def sent_between(report: LoadReport, start: float, end: float) -> list[Outcome]:
    return [o for o in report.outcomes if start <= o.sent_at < end]


def describe(outcomes: list[Outcome]) -> str:
    statuses = Counter(o.status for o in outcomes)
    latencies = sorted(o.latency_ms for o in outcomes)
    worst = latencies[-1] if latencies else 0
    return f"{len(outcomes)} sent: {dict(sorted(statuses.items()))}, slowest {worst:.0f} ms"


def samples(outcomes: list[Outcome], since: float, n: int = 12) -> str:
    """A few outcomes as 'sent +t s -> status in ms' (t from ``since``)."""
    return ", ".join(f"+{o.sent_at - since:.1f}s->{o.status} in {o.latency_ms:.0f}ms" for o in outcomes[:n])


def processes_alive(stack: Stack) -> dict[str, int | None]:
    return {name: proc.poll() for name, proc in stack.procs.items()}


def small_stack(tmp: Path, **settings: object) -> AbstractContextManager[Stack]:
    """One sim worker, the batcher and gunicorn with one process, heartbeats every 0.25 s."""
    return running_stack(tmp, web_workers=1, heartbeat_interval_s=0.25, settings=settings)


# -- 1. Redis SIGKILLed and restarted ----------------------------------------------------------------------------
@pytest.fixture
def redis_stack(tmp_path: Path, private_redis: PrivateRedis) -> Iterator[Stack]:
    with small_stack(tmp_path, redis_url=private_redis.url) as stack:
        yield stack


def test_redis_sigkilled_mid_load_gives_fast_503s_then_resumes(redis_stack: Stack,
                                                                private_redis: PrivateRedis) -> None:
    stack = redis_stack
    load = SteadyLoad(stack.url, 30, timeout_ms=8000, prefix="redis").start()
    try:
        wait_for(lambda: load.answered() >= 30, 15, "the load to flow")
        killed, sent_at_kill = time.monotonic(), load.sent
        private_redis.kill()
        _, during = wait_status(stack.url, 503, 5, "a 503 while Redis is away")
        hold(load, sent_at_kill, 3)  # an outage of 3 s of arrivals
        restarted = time.monotonic()
        private_redis.start()
        resumed, _ = wait_status(stack.url, 200, 30, "a 200 after Redis is back")
        hold(load, load.sent, 4)
    finally:
        report = load.stop()
    in_flight = [o for o in report.outcomes if o.sent_at < killed < o.sent_at + o.latency_ms / 1000]
    waited = max((o.sent_at + o.latency_ms / 1000 - killed for o in in_flight), default=0)
    print(f"\nredis kill: {report.summary()}\n  probe during the outage: {during}; "
          f"in flight at the kill: {describe(in_flight)}, the last answered {waited:.1f} s after it; "
          f"resumed {resumed - restarted:.1f} s after the restart")
    outage = sent_between(report, killed + 0.1, restarted)
    after = sent_between(report, resumed + 1, float("inf"))
    report.assert_sound(allow={200, 503})
    assert set(report.error_types) <= {"unavailable"}, report.summary()
    slow = [o for o in outage if o.status != 200 and o.latency_ms > 2000]
    ok = bool(outage) and not slow
    assert ok, f"503s during the outage must be fast (< 2 s): {describe(slow)}; " \
                                f"outage: {describe(outage)}"
    assert resumed - restarted < 5, f"service resumed only {resumed - restarted:.1f} s after Redis came back"
    ok = bool(after) and all(o.status == 200 for o in after)
    assert ok, f"after resuming: {describe(after)}"


# -- 2. every broker connection of the stack closed, twice --------------------------------------------------------
@pytest.fixture
def vhost_stack(tmp_path: Path, own_vhost: Vhost) -> Iterator[Stack]:
    with small_stack(tmp_path, broker_url=own_vhost.url) as stack:
        yield stack


def test_broker_connections_closed_twice_mid_load_loses_nobody(vhost_stack: Stack, own_vhost: Vhost) -> None:
    stack = vhost_stack
    load = SteadyLoad(stack.url, 30, timeout_ms=10_000, prefix="cut").start()
    cuts: list[tuple[float, int, float]] = []  # (when, connections closed, seconds it took)
    try:
        wait_for(lambda: load.answered() >= 30, 15, "the load to flow")
        for n in range(2):
            started, sent_at_cut = time.monotonic(), load.sent
            closed = own_vhost.close_connections(f"fault test: cut {n + 1}")
            cuts.append((started, closed, time.monotonic() - started))
            hold(load, sent_at_cut, 4)
        resumed, _ = wait_status(stack.url, 200, 30, "a 200 after the second cut", timeout_ms=10_000)
        hold(load, load.sent, 4)
    finally:
        report = load.stop()
    alive = processes_alive(stack)
    windows = "; ".join(f"cut {k + 1} ({closed} connections in {took:.1f} s): sent in the 4 s from it "
                        f"{describe(sent_between(report, at, at + 4))}" for k, (at, closed, took) in enumerate(cuts))
    print(f"\nbroker cuts: {report.summary()}\n  {windows}; processes {alive}")
    assert all(closed > 0 for _, closed, _ in cuts), f"nothing to cut: {cuts}"
    assert all(code is None for code in alive.values()), f"processes died: {alive}"
    report.assert_sound(allow={200, 503})
    assert set(report.error_types) <= {"unavailable"}, report.summary()
    after = sent_between(report, resumed + 1, float("inf"))
    ok = bool(after) and all(o.status == 200 for o in after)
    assert ok, f"after resuming: {describe(after)}"
    assert resumed - cuts[-1][0] < 15, f"resumed only {resumed - cuts[-1][0]:.1f} s after the second cut"


# -- 3. a memory alarm on the broker ---------------------------------------------------------------------------------
PUBLISH_TIMEOUT_S = 2.0
ALARM_TIMEOUT_MS = 6000


@pytest.fixture
def alarm_stack(tmp_path: Path, rabbit: PrivateRabbit) -> Iterator[Stack]:
    with small_stack(tmp_path, broker_url=rabbit.url, publish_timeout_s=PUBLISH_TIMEOUT_S) as stack:
        try:
            yield stack
        finally:
            rabbit.clear_alarms()  # before close(), which talks to the broker


def test_broker_memory_alarm_gives_503_within_the_publish_timeout_then_resumes(
        alarm_stack: Stack, rabbit: PrivateRabbit) -> None:
    stack = alarm_stack
    load = SteadyLoad(stack.url, 20, timeout_ms=ALARM_TIMEOUT_MS, prefix="alarm").start()
    try:
        wait_for(lambda: load.answered() >= 20, 15, "the load to flow")
        rabbit.raise_memory_alarm()
        wait_for(lambda: rabbit.alarms(), 10, "the memory alarm")
        alarmed, sent_at_alarm = time.monotonic(), load.sent
        _, during = wait_status(stack.url, 503, 15, "a 503 during the alarm")
        # longer than a deadline: a hung caller shows up as late
        hold(load, sent_at_alarm, ALARM_TIMEOUT_MS / 1000 + 2)
        cleared = time.monotonic()
        rabbit.clear_alarms()
        resumed, _ = wait_status(stack.url, 200, 30, "a 200 after the alarm cleared")
        hold(load, load.sent, 4)
    finally:
        report = load.stop()
    print(f"\nbroker alarm: {report.summary()}\n  probe during the alarm: {during}; "
          f"resumed {resumed - cleared:.1f} s after clearing")
    blocked = sent_between(report, alarmed, cleared - PUBLISH_TIMEOUT_S - 0.5)
    after = sent_between(report, resumed + 1, float("inf"))
    bound_ms = (PUBLISH_TIMEOUT_S + 1) * 1000
    # Admitted before the alarm, a request may still miss its deadline (its batch cannot be sent): 504 in time.
    report.assert_sound(allow={200, 503, 504})
    wrong = sorted((o for o in blocked if o.status != 503 or o.latency_ms > bound_ms), key=lambda o: o.status == 503)
    ok = bool(blocked) and not wrong
    assert ok, (
        f"during the alarm every caller must get 503 within {bound_ms:.0f} ms: {describe(wrong)} "
        f"of {describe(blocked)} (after the alarm: {samples(wrong, alarmed)})\n{report.summary()}")
    ok = bool(after) and all(o.status == 200 for o in after)
    assert ok, f"after the alarm: {describe(after)}"
    assert resumed - cleared < 10, f"resumed only {resumed - cleared:.1f} s after the alarm cleared"


# -- 4. a 10,000-connection flood from one tenant beside a steady one ---------------------------------------------
FLOOD = int(os.environ.get("LLMB_TEST_FLOOD_CONNECTIONS", "10000"))
FLOOD_TIMEOUT_MS = 20_000


@dataclass
class Raw:
    status: int  # 0: no HTTP answer
    latency_s: float  # from the start of connect() to the end of the response
    failure: str = ""  # why no answer: reset, eof, timeout, ...
    wrong_output: bool = False
    error_type: str = ""  # error.type of a JSON error answer
    message: str = ""  # and its message


async def _raw_post(host: str, port: int, body: dict[str, object], give_up_s: float) -> Raw:
    payload = json.dumps(body).encode()
    head = (f"POST /v1/infer HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    started = time.monotonic()
    writer = None

    async def exchange() -> Raw:
        nonlocal writer
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + payload)
        await writer.drain()
        header = await reader.readuntil(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next((int(v) for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "content-length"),
                      None)
        data = await (reader.readexactly(length) if length is not None else reader.read())
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if status == 200:
            wrong = not isinstance(answer, dict) or answer.get("output") != expected(str(body["input"]))
            return Raw(status, time.monotonic() - started, wrong_output=wrong)
        error = answer.get("error") if isinstance(answer, dict) else None
        kind = str(error.get("type")) if isinstance(error, dict) else "non-json"
        message = str(error.get("message")) if isinstance(error, dict) else data[:200].decode("latin-1")
        return Raw(status, time.monotonic() - started, error_type=kind, message=message)

    try:
        return await asyncio.wait_for(exchange(), give_up_s)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return Raw(0, time.monotonic() - started, "eof")
    except ConnectionResetError:
        return Raw(0, time.monotonic() - started, "reset")
    except TimeoutError:
        return Raw(0, time.monotonic() - started, "timeout")
    except (OSError, ValueError, IndexError) as exc:
        return Raw(0, time.monotonic() - started, type(exc).__name__)
    finally:
        if writer is not None:
            writer.close()


async def _flood(url: str, n: int, tenant: str, timeout_ms: int) -> list[Raw]:
    host, port = url.removeprefix("http://").split(":")
    give_up = timeout_ms / 1000 + 10
    return await asyncio.gather(*(
        _raw_post(host, int(port), {"input": f"flood {i} {uuid.uuid4().hex}", "tenant": tenant,
                                    "timeout_ms": timeout_ms}, give_up)
        for i in range(n)))


def _flood_elsewhere(url: str, n: int, tenant: str, timeout_ms: int) -> tuple[list[Raw], float]:
    """The flood from a process of its own (a fresh interpreter): what earlier tests left running in pytest's
    process (threads of in-process apps, a model's thread pool) must not slow the flood's client down, or
    the server sees headers arrive late and closes connections at its header time limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cpu = time.process_time()
    flood = asyncio.run(_flood(url, n, tenant, timeout_ms))
    return flood, time.process_time() - cpu


@pytest.fixture
def burst_stack(tmp_path: Path) -> Iterator[Stack]:
    """Default web settings (2 gunicorn processes, connections sized by the product); one sim worker at 100 ms
    batches (capacity 1,000 req/s)."""
    with running_stack(tmp_path, sim_batch_ms=100) as stack:
        yield stack


def test_a_connection_flood_from_one_tenant_leaves_a_steady_tenant_unharmed(burst_stack: Stack) -> None:
    stack = burst_stack
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    n = min(FLOOD, hard - 1000)  # room for the steady load's sockets, the stack's pipes, pytest
    try:
        steady = SteadyLoad(stack.url, 10, tenant="steady", prefix="steady", timeout_ms=10_000).start()
        try:
            wait_for(lambda: steady.answered() >= 10, 15, "the steady tenant's load to flow")
            started = time.monotonic()
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                flood, cpu = pool.apply(_flood_elsewhere, (stack.url, n, "flood", FLOOD_TIMEOUT_MS))
            flood_s = time.monotonic() - started
            hold(steady, steady.sent, 2)
        finally:
            report = steady.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    statuses = Counter(r.status for r in flood)
    errors = Counter(r.error_type for r in flood if r.error_type)
    messages = Counter(r.message[:100] for r in flood if r.message).most_common(3)
    failures = Counter(r.failure for r in flood if r.failure)
    late = [r for r in flood if r.latency_s > FLOOD_TIMEOUT_MS / 1000 + LATE_SLACK_S]
    wrong = sum(r.wrong_output for r in flood)
    lat_ms = [r.latency_s * 1000 for r in flood]
    p50, p99 = percentile(lat_ms, 50) or 0.0, percentile(lat_ms, 99) or 0.0  # 0 for no flood, never the case
    flood_line = (f"flood of {n} connections over {flood_s:.1f} s ({cpu:.1f} s of its client's CPU): "
                  f"statuses {dict(sorted(statuses.items()))}, "
                  f"errors {dict(errors)}, no answer {dict(failures)}, late {len(late)}, wrong output {wrong}, "
                  f"p50 {p50:.0f} ms p99 {p99:.0f} ms")
    steady_line = f"steady tenant: {report.summary()}"
    print(f"\n{flood_line}\n{steady_line}")
    both = f"\n{flood_line}\n  most frequent error messages: {messages}\n{steady_line}"
    problems = []
    if report.no_answer or report.late or report.wrong_output or set(report.statuses) - {200}:
        problems.append(f"the steady tenant was harmed (p50 {report.p(50):.0f} ms, p99 {report.p(99):.0f} ms)")
    if failures:
        problems.append(f"flood connections without an HTTP answer: {dict(failures)}")
    if set(statuses) - {200, 429, 0}:
        problems.append(f"flood answers other than 200/429: {dict(statuses)}")
    if late or wrong:
        problems.append(f"flood: {len(late)} late, {wrong} wrong outputs")
    if problems:
        pytest.fail("; ".join(problems) + both)


def test_a_publish_waiting_for_a_connection_behind_unconfirmed_ones_is_the_brokers_503_not_an_overload(
        rabbit: PrivateRabbit) -> None:
    """Under a memory alarm every pooled connection waits for a confirm that does not come; a publish that waits
    for one of them is told what they are told (503, the broker), not that this process is overloaded (429).
    Seen once in CI: 1 of 403 callers during an alarm got 429 'all 10 broker connections ... stayed busy'."""
    import threading

    from tasks.broker.queues import PublishTimeout, RequestPublisher
    from tasks.schema import InferenceRequest, Item

    publisher = RequestPublisher(rabbit.url, f"alarm-{uuid.uuid4().hex[:8]}", pool_size=1)
    now = time.time()
    request = InferenceRequest(id="r", tenant="t", model="sim", items=(Item("r.0", "x"),), accepted_at=now,
                               deadline=now + 30, reply_to="c")
    try:
        publisher.publish([request], 2.0)  # the queue exists, the connection is open
        rabbit.raise_memory_alarm()
        wait_for(lambda: rabbit.alarms(), 10, "the memory alarm")
        with pytest.raises(PublishTimeout):
            publisher.publish([request], 0.5)  # the broker is silent
        errors: list[BaseException] = []

        def publish() -> None:
            try:
                publisher.publish([request], 3.0)
            except BaseException as exc:  # what each caller gets is the point
                errors.append(exc)

        holder = threading.Thread(target=publish)
        holder.start()
        time.sleep(0.2)  # the one connection is taken, waiting for its confirm
        with pytest.raises(PublishTimeout):
            publisher.publish([request], 0.5)  # no connection came free: the broker's silence, not an overload
        holder.join(10)
        assert len(errors) == 1 and isinstance(errors[0], PublishTimeout), errors
    finally:
        rabbit.clear_alarms()
        publisher.close()
