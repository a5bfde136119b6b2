"""A connection accepted before its client wrote anything (webapp/worker.py, ``_TimedServer``): no greenlet until
its first bytes come, judged then by the door as one whose bytes came with its connection is at accept, closed
quietly if nothing comes in time, handed a greenlet when the server stops, and counted against the pool's bound
while it waits. A real gevent server on loopback, its door a stand-in that refuses what it can read whole."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gevent
import gevent.pool
import pytest

from webapp.connections import AtDoor
from webapp.worker import Arrivals, _TimedServer

REFUSAL = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class RefusingDoor:
    """Refuses every request whose bytes are there (UNSEEN when none are), noting each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, sock: Any, delay: float | None = None, *, arriving: bool = False,
                 arrived_at: float | None = None, in_line: bool = False, at_accept: bool = False) -> AtDoor:
        self.calls.append({"arrived_at": arrived_at, "at_accept": at_accept})
        sock.settimeout(0.0)
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return AtDoor.UNSEEN
        if not data.endswith(b"\r\n\r\n"):
            return AtDoor.UNSEEN
        sock.sendall(REFUSAL)
        return AtDoor.REFUSED

    def caller(self, sock: Any) -> str:
        return ""


def until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """Run the event loop until ``condition`` holds (failing after ``within_s``)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        gevent.sleep(0.01)


@pytest.fixture
def served() -> Iterator[tuple[_TimedServer, RefusingDoor, list[object], gevent.pool.Pool]]:
    """A server whose greenlets note their connection (``handled``) and end; it waits 0.3 s for a first byte."""
    door, handled = RefusingDoor(), []
    arrivals = Arrivals()
    arrivals.at_accept = door
    pool = gevent.pool.Pool(3)
    server_class = type("Server", (_TimedServer,), {"arrivals": arrivals, "first_byte_s": 0.3})
    server = server_class(("127.0.0.1", 0), handle=lambda sock, addr: handled.append(sock), spawn=pool)
    server.start()
    try:
        yield server, door, handled, pool
    finally:
        if not server.closed:
            server.close()


def connect(server: _TimedServer) -> socket.socket:
    client = socket.create_connection(server.address)
    client.settimeout(5.0)
    return client


@contextmanager
def awaiting(server: _TimedServer) -> Iterator[socket.socket]:
    """A client connected to ``server``, once the server watches its connection for a first byte."""
    client = connect(server)
    try:
        until(lambda: len(server._awaiting) == 1)
        yield client
    finally:
        client.close()


def test_a_request_written_after_the_connect_is_judged_as_its_bytes_come_without_a_greenlet(served: Any) -> None:
    server, door, handled, pool = served
    with awaiting(server) as client:
        assert [c["at_accept"] for c in door.calls] == [True]  # at accept: nothing to judge yet
        assert pool.free_count() == pool.size and not handled
        client.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: api\r\n\r\n")
        sent = time.monotonic()
        until(lambda: len(door.calls) == 2)
        assert door.calls[1]["at_accept"] and abs(door.calls[1]["arrived_at"] - sent) < 0.2  # from its bytes
        until(lambda: not server._awaiting)
        assert client.recv(1024) == REFUSAL and not handled  # answered from the event loop: no greenlet ran


def test_a_connection_whose_request_is_let_in_gets_its_greenlet_when_its_bytes_come(served: Any) -> None:
    server, door, handled, _ = served
    with awaiting(server) as client:
        client.sendall(b"POST /v1/infer HTTP/1.1\r\n")  # not all of it: the door cannot judge it from here
        until(lambda: len(handled) == 1)
        assert not server._awaiting and len(door.calls) == 2


def test_a_connection_that_sends_nothing_is_closed_quietly_after_the_first_byte_time(served: Any) -> None:
    server, _, handled, _ = served
    with awaiting(server) as client:
        until(lambda: not server._awaiting)
        assert client.recv(1024) == b"" and not handled  # closed without an answer, as an idle connection is


def test_connections_awaiting_their_bytes_count_against_the_pool_and_get_greenlets_when_the_server_stops(
        served: Any) -> None:
    server, _, handled, _ = served
    clients = [connect(server) for _ in range(3)]
    try:
        until(lambda: len(server._awaiting) == 3)
        assert server.full()  # three awaiting in a pool of three: nothing more is accepted meanwhile
        late = connect(server)  # connected in the kernel, left in the listen queue
        clients.append(late)
        gevent.sleep(0.05)
        assert len(server._awaiting) == 3
        server.close()  # their clients connected to send: each gets a greenlet, which waits for the request
        assert not server._awaiting
        until(lambda: len(handled) == 3)
    finally:
        for client in clients:
            client.close()
