"""When a request arrived (webapp/connections.py, webapp/worker.py): the kernel's stamp of its first byte, so
neither a client's delay between connecting and writing nor the process's own delay in looking is mistimed."""
from __future__ import annotations

import socket
import time

from webapp import connections
from webapp.worker import arrived_at


def test_a_request_written_after_the_connect_arrived_when_its_bytes_came_not_when_they_were_looked_at() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    connections.stamp_arrivals(listener)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    accepted = time.monotonic()
    try:
        time.sleep(0.3)  # a busy client writes its request a while after connecting
        client.sendall(b"POST /v1/infer HTTP/1.1\r\n")
        sent = time.monotonic()
        time.sleep(0.3)  # ... and this process gets round to it later still
        seen = connections.IDLE.wait(server, 1.0, kept=False)
        assert seen is not None and abs(seen - sent) < 0.05, (seen, sent)
        arrived = arrived_at(accepted, seen)
        assert abs(arrived - sent) < 0.05  # its deadline and the door's delay count from here
    finally:
        for sock in (client, server, listener):
            sock.close()


def test_bytes_that_came_with_the_connection_arrived_at_its_accept() -> None:
    accepted = time.monotonic()
    assert arrived_at(accepted, accepted - 0.2) == accepted  # they waited in the accept queue with it
    assert arrived_at(None, 12.5) == 12.5  # a later request on a kept-alive connection: its own bytes' time
    before = time.monotonic()
    assert arrived_at(None, None) >= before  # nothing known: now
