"""Connections as pooled clients use them (webapp/connections.py), against real gunicorn at its defaults.

A pooled client (httpx under the openai client, requests.Session, an aiohttp session) reuses a kept-alive
connection whenever it has one: the server must never close a connection on which a request has started to
arrive, must keep idle ones longer than clients' pool expiry, and must answer (not drop) what it refuses.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import pooled
from harness.services import Vhost
from harness.stack import Stack, running_stack, wait_for
from webapp.connections import STOP_GRACE_S

GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The web API at its shipped connection settings (keep-alive 75 s, header timeout 10 s)."""
    with running_stack(Path(tmp_path_factory.mktemp("connections")), sim_batch_ms=20) as s:
        yield s


def _connect(stack: Stack) -> socket.socket:
    return socket.create_connection(("127.0.0.1", stack.port), timeout=15)


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (Content-Length framed) from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_an_idle_connection_outlives_common_clients_pool_expiry(defaults: Stack) -> None:
    """Idle 6 s (httpx expires its connections at 5 s, gunicorn's own keep-alive was 5 s): the connection is still
    open and serves the next request, whose headers may then take their time (the limit counts from their first
    byte, not from the previous response)."""
    sock = _connect(defaults)
    sock.sendall(GET)
    assert _response(sock)[0] == 200
    assert not _closed_within(sock, 6.0), "the server closed an idle connection before 6 s"
    sock.settimeout(15)
    for i in range(0, len(GET), 4):  # the next request's headers over about 2 s
        sock.sendall(GET[i:i + 4])
        time.sleep(0.2)
    status, headers, body = _response(sock)
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert headers.get("connection", "").lower() != "close"
    sock.close()


def test_headers_too_slow_get_a_json_408_counted_from_their_first_byte(defaults: Stack) -> None:
    """Slow-header protection at the default 10 s: one byte every 0.5 s is answered 408 in JSON (not dropped),
    then the connection ends."""
    sock = _connect(defaults)
    sock.sendall(GET)
    assert _response(sock)[0] == 200
    assert not _closed_within(sock, 1.0)  # idle first (and still open): the header timer must not start yet
    started = time.monotonic()
    request = b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 100 + b"\r\n\r\n"
    sock.settimeout(0.5)
    got = b""
    for byte in request:
        try:
            sock.send(bytes([byte]))
        except OSError:
            break
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        got += chunk
        if not chunk or b"\r\n\r\n" in got:
            break
    elapsed = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 408"), got[:300]
    assert 9.0 <= elapsed < 14.0, elapsed
    body = json.loads(got.partition(b"\r\n\r\n")[2])
    assert body["error"]["type"] == "request_timeout" and "LLMB_HEADER_TIMEOUT_S" in body["error"]["message"]
    assert _closed_within(sock, 5.0)
    sock.close()


@pytest.mark.parametrize(("request_bytes", "status", "type_"), [
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431, "headers_too_large"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431,
     "headers_too_large"),
    (b"BROKEN\r\n\r\n", 400, "invalid_request"),
])
def test_gunicorns_own_refusals_are_json(defaults: Stack, request_bytes: bytes, status: int, type_: str) -> None:
    sock = _connect(defaults)
    sock.sendall(request_bytes)
    got, headers, body = _response(sock)
    assert got == status, body[:200]
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["type"] == type_ and "<" not in error["message"]
    assert _closed_within(sock, 5.0)
    sock.close()


def test_a_stopping_api_process_closes_idle_connections_after_its_stop_grace(defaults: Stack) -> None:
    """SIGTERM with idle kept-alive connections open: they are closed once STOP_GRACE_S has passed (a request on
    one meanwhile is answered with Connection: close, rather than racing the close), so the stop does not wait out
    the 75 s keep-alive or the 30 s graceful timeout."""
    url = defaults.start_web("web-stop", workers=1)
    port = int(url.rsplit(":", 1)[1])
    idle = []
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        sock.sendall(GET)
        assert _response(sock)[0] == 200
        idle.append(sock)
    started = time.monotonic()
    defaults.signal("web-stop", signal.SIGTERM)
    assert all(_closed_within(sock, STOP_GRACE_S + 3) for sock in idle)
    defaults.wait_exit("web-stop", timeout_s=STOP_GRACE_S + 6)
    assert time.monotonic() - started < STOP_GRACE_S + 6
    for sock in idle:
        sock.close()


def test_a_request_on_a_kept_alive_connection_of_a_stopping_process_is_answered_then_closed(defaults: Stack) -> None:
    """A pooled client sends on its kept-alive connection while the API process stops (a SIGHUP reload, a rolling
    upgrade): the request is answered, with Connection: close, and only then is the connection closed. Closing it
    at once raced such requests (a reset, or "server disconnected")."""
    url = defaults.start_web("web-grace", workers=1)
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.sendall(GET)
    assert _response(sock)[0] == 200
    defaults.signal("web-grace", signal.SIGTERM)

    def answered_with_close() -> bool:  # until the worker has taken the stop in: answered as usual before
        sock.sendall(GET)
        status, headers, _ = _response(sock)
        assert status == 200, status
        return headers.get("connection", "").lower() == "close"

    wait_for(answered_with_close, 10, "a request on the kept-alive connection answered with Connection: close")
    assert _closed_within(sock, 5.0)
    sock.close()
    defaults.wait_exit("web-grace", timeout_s=STOP_GRACE_S + 6)


def test_one_pooled_session_a_flood_beside_a_steady_tenant_sees_no_connection_error(tmp_path: Path) -> None:
    """One aiohttp session (a web backend's pool) for two tenants, keys on, one 250 ms sim worker (400/s): B
    sends 20 calls/s while A sends 5,000 at once. Every call gets an HTTP answer in JSON (old main: 21 of B's
    200 got connection errors); B's are 200 but for a rare one at the flood's onset."""
    with pooled.keyed_stack(tmp_path) as stack:
        a, b = pooled.key(stack, "a"), pooled.key(stack, "b")

        async def run() -> tuple[list[pooled.Call], list[pooled.Call]]:
            async with pooled.session() as http:
                steady = asyncio.ensure_future(pooled.steady(http, stack.url, "b", 20, 10, key=b))
                while stack.items_done() < 10:  # B is steady before A's flood starts (as in the issue)
                    await asyncio.sleep(0.05)
                flood = await pooled.burst(stack.url, 5000, "a", key=a, timeout_ms=10_000, http=http)
                return await steady, flood

        b_calls, a_calls = asyncio.run(run())
        log = stack.log("web")
    for name, calls in (("B", b_calls), ("A", a_calls)):
        report = pooled.summary(calls)
        assert report["connection_errors"] == 0, (name, report)
        assert report["not_json"] == 0 and report["wrong_output"] == 0, (name, report)
    b_report = pooled.summary(b_calls)
    # B keeps its share: at the flood's very onset, before A counts as the heavier caller, a call of B's can
    # still wait behind A's queue at the gate (seen: 0-2 of 200); before the gate let light tenants pass, 45-65
    assert b_report["statuses"].get(200, 0) >= 0.97 * len(b_calls), (b_report["error_types"], b_report["messages"])
    assert set(pooled.summary(a_calls)["statuses"]) <= {200, 429}, pooled.summary(a_calls)
    assert "Traceback" not in log


def test_a_burst_is_absorbed_in_arrival_order(tmp_path: Path) -> None:
    """3,000 calls at once on one pool (keys on, 5 s deadline) into an idle 400/s worker: a share of them is
    answered (not every call refused because the process fell behind: its delay counts from when a request's
    bytes came, not from a busy client's connect), each answer within its deadline plus a second, hardly any
    admitted call left to time out, every other answer a JSON error, and nobody gets a connection error."""
    with pooled.keyed_stack(tmp_path) as stack:
        key = pooled.key(stack, "a")
        # measured before its first call (a full warm-up batch): admission's deadline cap holds from the start
        assert all(w["batch_ms_estimate"] > 0 for w in stack.fleet().values()), stack.fleet()
        calls = asyncio.run(pooled.burst(stack.url, 3000, "a", key=key, timeout_ms=5000))
    report = pooled.summary(calls)
    assert report["connection_errors"] == 0 and report["not_json"] == 0 and report["wrong_output"] == 0, report
    assert report["statuses"].get(200, 0) >= 200, report  # (old main: 0-152 of 3,000, every other call 429)
    # admitted means answered: before workers measured a batch at start, 994-1,703 of 3,000 ended 504 in some
    # runs (the cap was at its maximum until the first batch was measured); measured since, alone on the host:
    # none in 11 runs, and 47 once with a second whole system running its tests on the same two cores
    assert report["statuses"].get(504, 0) <= 0.05 * len(calls), report
    client_lag_s = 2.0  # this client's own CPU time to open 3,000 calls on the same two cores (measured ~1-2 s)
    assert max(c.latency_s for c in calls if c.status == 200) < 5.0 + 1.0 + client_lag_s, report


def test_every_broker_connection_closed_twice_a_pooled_caller_is_answered_within_its_deadline(
        tmp_path: Path, own_vhost: Vhost) -> None:
    """40 calls/s on one aiohttp session, 4 s deadlines (keys on, one 250 ms worker), and every connection of the
    system's vhost closed twice under it: each call gets its own 200, or a JSON refusal while a publisher is
    down; none is admitted to time out and nobody sees a connection error. Before the prefetch reduction was
    turned off, a GPU worker could sit ~3 s after its reconnect without taking a batch until RabbitMQ closed
    its new connection for missed heartbeats (2 of 6 runs: 18-78 calls 504)."""
    with pooled.keyed_stack(tmp_path, broker_url=own_vhost.url) as stack:
        key = pooled.key(stack, "cut")

        async def run() -> list[pooled.Call]:
            async with pooled.session() as http:
                load = asyncio.ensure_future(pooled.steady(http, stack.url, "cut", 40, 12, key=key, timeout_ms=4000))
                for answered in (100, 260):  # a cut after ~2.5 s of load, another ~4 s later
                    while stack.items_done() < answered and not load.done():
                        await asyncio.sleep(0.05)
                    assert await asyncio.to_thread(own_vhost.close_connections) > 0
                return await load

        calls = asyncio.run(run())
    report = pooled.summary(calls)
    assert report["connection_errors"] == 0 and report["not_json"] == 0 and report["wrong_output"] == 0, report
    assert set(report["statuses"]) <= {200, 503}, report
    assert max(c.latency_s for c in calls) < 4.0 + 1.0, report
