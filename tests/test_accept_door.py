"""The door at accept: a request on a just-accepted connection refused from the bytes already arrived, while the
process is behind (a socket pair for the connection, a gate whose expected wait the test sets)."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from webapp import worker
from webapp.app import is_inference
from webapp.door import AcceptDoor, Door


class Gate:
    """Stands in for the admission gate: only how long a call would wait for its turn matters here."""

    def __init__(self) -> None:
        self.wait_s = 0.0

    def expected_wait_s(self) -> float:
        return self.wait_s

    def retry_after_s(self) -> int:
        return 3


@pytest.fixture
def behind() -> Iterator[None]:
    """A connection accepted half a second ago is still waiting for this process to get to it."""
    token = object()
    worker._unstarted[token] = time.monotonic() - 0.5
    yield
    worker._unstarted.pop(token, None)


def request(body: dict[str, object], *, tenant: str | None = None, cut: int = 0) -> bytes:
    payload = json.dumps(body).encode()
    extra = f"X-Tenant: {tenant}\r\n" if tenant else ""
    head = (f"POST /v1/infer HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\nX-Request-Id: caller-7\r\n"
            f"{extra}Content-Length: {len(payload)}\r\n\r\n").encode()
    return (head + payload)[:len(head) + len(payload) - cut]


def connection(data: bytes) -> tuple[socket.socket, socket.socket]:
    client, server = socket.socketpair()
    client.sendall(data)
    return client, server


def answer(client: socket.socket) -> tuple[str, dict[str, str], dict[str, object]]:
    client.settimeout(5)
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, dict(line.split(": ", 1) for line in lines), json.loads(body)


def test_a_request_is_refused_at_accept_with_the_doors_json_429_while_the_process_is_behind(behind: None) -> None:
    gate = Gate()
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, gate=gate)  # type: ignore[arg-type]
    accept = AcceptDoor(door, is_inference)
    client, server = connection(request({"input": "hello"}))
    assert not accept(server)  # half a second behind, and no wait at the gate: it can still be served in time
    assert server.recv(65536, socket.MSG_PEEK).startswith(b"POST /v1/infer")  # nothing taken off the socket
    gate.wait_s = 0.8  # 0.5 s behind + 0.8 s for its turn > 1 s
    assert accept(server)
    server.close()
    status, headers, body = answer(client)
    assert status == "HTTP/1.1 429 Too Many Requests"
    assert headers["Retry-After"] == "3" and headers["Connection"] == "close" and headers["X-Request-Id"] == "caller-7"
    error = body["error"]
    assert isinstance(error, dict) and error["type"] == "overloaded" and error["request_id"] == "caller-7"


def test_what_the_door_at_accept_cannot_read_whole_or_may_let_in_goes_the_usual_way(behind: None) -> None:
    gate = Gate()
    gate.wait_s = 5.0
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, gate=gate)  # type: ignore[arg-type]
    accept = AcceptDoor(door, is_inference)
    _, partial = connection(request({"input": "hello"}, cut=3))  # the body not all there yet
    assert not accept(partial)
    _, other = connection(b"GET /metrics HTTP/1.1\r\nHost: api\r\n\r\n")
    assert not accept(other)
    for _ in range(50):  # one heavy caller...
        door.callers.arrived("flood")
    _, light = connection(request({"input": "hello"}, tenant="steady"))
    assert not accept(light)  # ...does not get a light one refused
    _, in_body = connection(request({"input": "hello", "tenant": "flood"}))
    assert accept(in_body)
