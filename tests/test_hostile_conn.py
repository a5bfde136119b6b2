"""Hostile connections (issue 43, items 3 and 4): pipelined requests are answered each by its own, in order, never
by a refusal judged from another request's bytes; a client that stops reading (a stream's, a resumed stream's)
frees what it holds within the send timeout; a resume is marked only once admitted, and only for its own call.

The first tests are units (no processes); those named ``..._through_gunicorn`` run a stack (sim workers, one
gunicorn process), bounded in count and time, loopback only."""
from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import gevent
import gevent.socket
import pytest
import redis
import requests

from harness.hostile import chat_request, read_answers, slow_reader
from harness.stack import Stack, running_stack, wait_for
from tasks.errors import Overloaded
from tasks.gateway.gateway import Gateway
from tasks.gateway.resume import MAX_RESUMING_PER_TENANT, Resumer
from tasks.state.journal import Journal
from tasks.state.keys import Keys
from tasks.state.records import Record, Shape
from tasks.state.results import ResultListener
from webapp.connections import AtDoor, NextRequest
from webapp.intake import Intake
from webapp.worker import send_all

POST = (b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: %s\r\n"
        b"Content-Length: %d\r\n\r\n%s")


def _post(request_id: str, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return POST % (request_id.encode(), len(raw), raw)


class _Parser:
    """gunicorn's parser as NextRequest sees it: the previous body read, ``held`` bytes read ahead."""

    def __init__(self, held: bytes) -> None:
        self.unreader = SimpleNamespace(buf=io.BytesIO(held))

    def finish_body(self, deadline: float) -> bool:
        return True


class _Door:
    """The door at the socket, refusing whatever it is asked about (taking it off the socket), and noting what it
    saw there."""

    def __init__(self) -> None:
        self.saw: list[bytes] = []

    def __call__(self, sock: socket.socket, waited_s: float | None, arriving: bool) -> AtDoor:
        self.saw.append(sock.recv(65536))
        return AtDoor.REFUSED


def _next_request(held: bytes, kernel: bytes) -> tuple[_Door, bool]:
    """A connection whose parser holds ``held`` and whose socket has ``kernel`` waiting: what the door was asked
    about, and whether the request was refused (StopIteration) rather than parsed."""
    server, client = socket.socketpair()
    with server, client:
        client.sendall(kernel)
        client.shutdown(socket.SHUT_WR)
        door = _Door()
        wait = NextRequest(server, _Parser(held), 1.0, 1.0, 1.0, lambda at: None, intake=Intake(), refuse=door)
        try:
            with wait:
                pass
        except StopIteration:
            return door, True
        return door, False


def test_a_pipelined_request_the_parser_holds_is_not_judged_by_the_next_ones_bytes() -> None:
    """Before: the parser held request B (read ahead with A), the socket had C; the door peeked C and refused, and
    its 429 went out as B's answer (B never read, C taken off the socket unanswered). Now the door steps aside for
    B: it is parsed and judged as any request (the door middleware); C is judged when its turn comes."""
    b, c = _post("b", {"inputs": ["b"]}), _post("c", {"inputs": ["c"], "model": "refuse-me"})
    door, refused = _next_request(b, c)
    assert not refused and door.saw == []
    door, refused = _next_request(b[:20], b[20:] + c)  # part of B held, its rest (then C) on the socket
    assert not refused and door.saw == []
    door, refused = _next_request(b"", c)  # nothing held: the socket's bytes are the request's own
    assert refused and door.saw == [c]


def test_a_client_that_takes_no_bytes_is_given_up_within_the_send_timeout() -> None:
    """gevent's sockets have no send timeout: a write to a client that reads nothing waited until TCP gave up."""
    server, client = gevent.socket.socketpair()
    with server, client:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        started = time.monotonic()
        with pytest.raises(BrokenPipeError):  # noqa: PT012  (the buffers fill first)
            for _ in range(1000):  # 64 MB at most: far past any socket buffer
                send_all(server, b"x" * 65536, 0.3)
        assert time.monotonic() - started < 3.0
        assert server.gettimeout() is None  # the socket's own timeout is back for its next reads
        reader = gevent.spawn(lambda: client.recv(1 << 20))
        got = len(reader.get(timeout=5))
        send_all(server, b"y" * 10, 0.3)  # a client that reads again is written to as before
        assert got > 0


def test_a_refusal_with_requests_pipelined_behind_it_closes_without_a_reset() -> None:
    """The door takes the refused request off the socket and answers it; the requests behind it were never read.
    Before: the connection was closed with them unread, so the kernel sent RST (the client could lose the 429).
    Now the close lingers: the client reads the 429, then the end of the connection."""
    c, d = _post("c", {"inputs": ["c"]}), _post("d", {"inputs": ["d"]})
    answer = b"HTTP/1.1 429 Too Many Requests\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"

    def door(sock: socket.socket, waited_s: float | None, arriving: bool) -> AtDoor:
        sock.recv(len(c))  # as the door at accept does: the refused request, all there
        sock.sendall(answer)
        return AtDoor.REFUSED

    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        server, _ = listener.accept()
        client.sendall(c + d)
        client.shutdown(socket.SHUT_WR)  # all it sends: the lingering close ends when it has read that
        time.sleep(0.05)
        with pytest.raises(StopIteration), server, NextRequest(server, _Parser(b""), 1.0, 1.0, 1.0, lambda at: None,
                                                               intake=Intake(), refuse=door):
            pass
        got = b""
        while chunk := client.recv(65536):  # ConnectionResetError here before
            got += chunk
        assert got == answer


def _record(request_id: str, item: str) -> Record:
    return Record(request_id, "alice", "sim-lm", (item,), accepted_at=0.0, deadline=1.0, instance="gone",
                  shape=Shape(route="chat", stream=True))


class _Redis:
    """The two commands a journal's resume marks use, on a dict."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def set(self, key: str, value: object, ex: int) -> None:
        self.keys.add(key)

    def exists(self, key: str) -> int:
        return int(key in self.keys)


def _marks() -> Journal:
    return Journal(cast(redis.Redis, _Redis()), Keys("t"), 60)


class _Nothing:  # a journal and a listener with nothing in them
    def read(self, after: object) -> dict[str, object]:
        return {}

    def fetch(self, ids: object) -> dict[str, object]:
        return {}


def _gateway(records: dict[str, Record], marks: Journal, resumer: Resumer) -> Any:
    """Gateway.resume's view of a gateway: its calls, its journal's marks, its resumer."""
    return SimpleNamespace(lookup=lambda tenant, rid: SimpleNamespace(record=records[rid]) if rid in records else None,
                           _journal=marks, _resumer=resumer)


def test_a_refused_resume_leaves_cancel_on_disconnect_on() -> None:
    """Before: the mark was set before the cap's check, so a resume refused 429 still kept the call from being
    cancelled when its first client left. Now only an admitted resume marks it."""
    marks = _marks()
    resumer = Resumer(cast(Journal, _Nothing()), cast(ResultListener, _Nothing()), clock=lambda: 1e12)
    records = {f"r{i}": _record(f"r{i}", f"i{i}") for i in range(MAX_RESUMING_PER_TENANT + 1)}
    gateway = _gateway(records, marks, resumer)
    held = [Gateway.resume(gateway, "alice", f"r{i}", None) for i in range(MAX_RESUMING_PER_TENANT)]
    for resumed in held:
        assert resumed is not None
        next(iter(resumed.events))  # running: it holds its slot
    refused = f"r{MAX_RESUMING_PER_TENANT}"
    with pytest.raises(Overloaded):
        Gateway.resume(gateway, "alice", refused, None)
    assert not marks.resumed("alice", refused, records[refused].items)
    assert all(marks.resumed("alice", f"r{i}", (f"i{i}",)) for i in range(MAX_RESUMING_PER_TENANT))


def test_a_reused_request_id_is_not_taken_for_the_resumed_call() -> None:
    """Before: the mark was the request id's for the result TTL, so a later call reusing it was never cancelled
    when its client left. Now it names the call (its first item)."""
    marks = _marks()
    resumer = Resumer(cast(Journal, _Nothing()), cast(ResultListener, _Nothing()), clock=lambda: 1e12)
    first = _record("same", "first-item")
    assert Gateway.resume(_gateway({"same": first}, marks, resumer), "alice", "same", None) is not None
    assert marks.resumed("alice", "same", first.items)
    assert not marks.resumed("alice", "same", _record("same", "second-item").items)


# -- through gunicorn -----------------------------------------------------------------------------------------------


LM = "sim-lm"
# Long enough that the slow readers of a resume hold their slots together for seconds (the test sees that window
# once; at 1 s a CI host's stall missed it), short enough that a slow stream is cancelled well before it ends.
SEND_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("hostile-conn")), workers=[(0, {"backend": "sim-lm"})],
                       web_workers=1, stream_send_timeout_ms=int(SEND_TIMEOUT_S * 1000),
                       stream_resume_ms=2000, sim_lm_eos_mean=0) as s:  # no EOS: every call its max_tokens
        yield s


@pytest.mark.parametrize("count", [2, 10])
def test_pipelined_requests_are_answered_each_by_its_own_in_order_through_gunicorn(stack: Stack, count: int) -> None:
    """``count`` requests in one write, among them some refused (an unknown model, an invalid body): each answer
    is its own request's (its X-Request-Id), in order, none lost or answered twice, no reset."""
    sent: list[tuple[str, bytes]] = []
    for i in range(count):
        rid = f"pipe-{count}-{i}-{time.monotonic_ns()}"
        if i % 5 == 1:
            sent.append((rid, chat_request(rid, model="no-such-model")))  # refused: no worker serves it
        elif i % 5 == 3:
            sent.append((rid, chat_request(rid, max_tokens=-1)))  # refused: invalid
        else:
            sent.append((rid, chat_request(rid)))
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as sock:
        sock.sendall(b"".join(raw for _, raw in sent))
        answers, reset, left = read_answers(sock, count, 60)
        assert not reset and left == b""
        assert [h.get("x-request-id") for _, h in answers] == [rid for rid, _ in sent]
        for (rid, _), (status, _) in zip(sent, answers, strict=True):
            i = int(rid.split("-")[2])
            assert (status == 200) == (i % 5 not in (1, 3)), (rid, status)
            assert status != 429, "no refusal judged from another request's bytes"
        sock.settimeout(0.5)  # nothing more comes: none answered twice
        with pytest.raises(TimeoutError):
            sock.recv(1)


def _long_stream(request_id: str) -> bytes:
    return chat_request(request_id, max_tokens=1000, n=4, stream=True)  # about 12 s of decoding, 4,000 events (~1 MB)


def _item_ids(stack: Stack, request_id: str) -> list[str]:
    found: list[str] = []

    def recorded() -> bool:
        record = stack.redis.get(f"{stack.namespace}:request:default:{request_id}")
        found[:] = [] if record is None else json.loads(record)["items"]
        return bool(found)

    wait_for(recorded, 10, f"the record of {request_id}")
    return found


def test_a_stream_whose_client_stops_reading_is_cancelled_within_the_send_timeout_through_gunicorn(
        stack: Stack) -> None:
    """Before: the write to a client that reads nothing waited until TCP gave up; the generation ran on to its
    end, then the greenlet held its connection. Now the write gives up after the send timeout, the stream's
    iterator is closed as when its client leaves, and its generation is cancelled after the resume window (before
    it ends: were it not, it would finish uncancelled)."""
    cancels = stack.redis.pubsub()
    cancels.subscribe(f"{stack.namespace}:cancel")
    rid = f"slow-stream-{time.monotonic_ns()}"
    started = time.monotonic()
    with slow_reader(stack.port, _long_stream(rid)):
        items = _item_ids(stack, rid)
        heard: set[str] = set()

        def cancelled() -> bool:
            message = cancels.get_message(timeout=0.2)
            if message and message["type"] == "message":
                heard.update(message["data"].decode().split(","))
            return set(items) <= heard

        wait_for(cancelled, 18, "the cancellation of the stream its client stopped reading")
    assert time.monotonic() - started < 18


def test_resumes_whose_clients_stop_reading_free_their_slots_within_the_send_timeout_through_gunicorn(
        stack: Stack) -> None:
    """A tenant's resumed streams fill its share of them (MAX_RESUMING_PER_TENANT), each read by nobody. Before:
    each held its slot until TCP gave up (its generator suspended in a write), so the tenant's resumes were
    refused 429 for as long. Now the writes give up after the send timeout and the slots are freed."""
    rid = f"resumed-{time.monotonic_ns()}"
    with requests.Session() as session:
        with session.post(stack.url + "/v1/chat/completions", data=_long_stream(rid).split(b"\r\n\r\n", 1)[1],
                          headers={"Content-Type": "application/json", "X-Request-Id": rid}, stream=True,
                          timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # its client leaves after its first event: the call runs on for a resume
        resume = (f"GET /v1/requests/{rid}/stream HTTP/1.1\r\nHost: x\r\n\r\n").encode()
        slow = [slow_reader(stack.port, resume) for _ in range(MAX_RESUMING_PER_TENANT)]
        try:
            # every slow reader holds its slot before the tenant's own resumes are tried: one tried first took a
            # slot for a moment, a slow reader was refused meanwhile, and no resume was ever refused (CI, once)
            wait_for(lambda: all(len(_peek(sock, 12)) == 12 for sock in slow), 10, "the slow readers answered")
            assert {_peek(sock, 12) for sock in slow} == {b"HTTP/1.1 200"}
            url = f"{stack.url}/v1/requests/{rid}/stream"

            def resumes() -> int:
                with session.get(url, stream=True, timeout=10) as again:
                    return again.status_code

            wait_for(lambda: resumes() == 429, 5, "the slow readers holding every resume slot of the tenant")
            started = time.monotonic()
            wait_for(lambda: resumes() == 200, 18, "a resume slot freed by a reader that stopped reading")
            assert time.monotonic() - started < 18
        finally:
            for sock in slow:
                sock.close()


def _peek(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes the server sent, left unread (a slow reader still reads nothing)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(n, socket.MSG_PEEK)
    except TimeoutError:
        return b""


def test_a_reused_request_id_after_a_resumed_call_is_still_cancelled_when_its_client_leaves_through_gunicorn(
        stack: Stack) -> None:
    """Before: a resume marked the request id for the results' TTL, so a later call reusing that X-Request-Id ran on
    to its end when its client left (never cancelled). Now the mark names the resumed call only."""
    cancels = stack.redis.pubsub()
    cancels.subscribe(f"{stack.namespace}:cancel")
    rid = f"reused-{time.monotonic_ns()}"
    body = json.loads(chat_request(rid, max_tokens=1000, stream=True).split(b"\r\n\r\n", 1)[1])
    with requests.Session() as session:
        def left_after_first_event() -> None:
            with session.post(stack.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid},
                              stream=True, timeout=60) as r:
                assert r.status_code == 200
                next(r.iter_lines())

        left_after_first_event()  # the first call: its client leaves, and comes back
        first = _item_ids(stack, rid)
        with session.get(f"{stack.url}/v1/requests/{rid}/stream", stream=True, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        assert stack.redis.keys(f"{stack.namespace}:resumed:default:{rid}*")
        left_after_first_event()  # the same request id again: its client leaves for good

        def second_recorded() -> bool:
            return _item_ids(stack, rid) != first

        wait_for(second_recorded, 10, "the second call's record")
        second = _item_ids(stack, rid)
    heard: set[str] = set()

    def cancelled() -> bool:
        message = cancels.get_message(timeout=0.2)
        if message and message["type"] == "message":
            heard.update(message["data"].decode().split(","))
        return set(second) <= heard

    wait_for(cancelled, 15, "the cancellation of the second call (the resume window is 2 s)")
    assert not set(first) & heard, "the resumed call runs on"
