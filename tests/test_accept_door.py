"""The door at accept: a request on a just-accepted connection refused from the bytes already arrived, while the
process is behind (a socket pair for the connection, a gate whose expected wait the test sets), while the
gateway holds a FULL verdict for its model and class, or as it arrives beyond what its model's line can answer
in time (a stand-in for the gateway's verdicts and line, the real tenant directory on SQLite)."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from prometheus_client import REGISTRY

from tasks.config import Settings
from tasks.errors import Overloaded, QueueFull
from tasks.policy.room import Placed
from tasks.policy.shedding import Door
from tasks.schema import Priority
from tasks.store.directory import TenantDirectory
from tasks.store.tenants import KeyStore
from webapp import accept_door
from webapp.accept_door import AcceptDoor, QueueShedding
from webapp.app import is_inference
from webapp.connections import AtDoor
from webapp.peek import Peeked
from webapp.worker import Arrivals


class Gate:
    """Stands in for the admission gate: only how long a call would wait for its turn matters here."""

    def __init__(self) -> None:
        self.wait_s = 0.0

    def expected_wait_s(self) -> float:
        return self.wait_s

    def retry_after_s(self) -> int:
        return 3


@pytest.fixture
def behind() -> Arrivals:
    """A connection accepted half a second ago is still waiting for this process to get to it."""
    arrivals = Arrivals()
    arrivals.unstarted[object()] = time.monotonic() - 0.5
    return arrivals


def request(body: dict[str, object], *, tenant: str | None = None, cut: int = 0, path: str = "/v1/infer",
            headers: dict[str, str] | None = None) -> bytes:
    payload = json.dumps(body).encode()
    extra = f"X-Tenant: {tenant}\r\n" if tenant else ""
    extra += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\nX-Request-Id: caller-7\r\n"
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


def test_a_request_is_refused_at_accept_with_the_doors_json_429_while_the_process_is_behind(behind: Arrivals) -> None:
    gate = Gate()
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, backlog=behind.backlog, gate=gate)
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


def test_a_refusal_at_accept_is_timed_from_the_requests_arrival_in_the_latency_histogram(behind: Arrivals) -> None:
    """The door's 429s go into ``llmb_request_duration_seconds{status="429"}`` as Flask's do, timed from when the
    request arrived: under a flood they are most of the refusals, and their delay is what a caller waits."""
    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(f"llmb_request_duration_seconds_{name}", {"status": "429", **labels}) or 0.0

    gate = Gate()
    gate.wait_s = 0.8
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, backlog=behind.backlog, gate=gate)
    accept = AcceptDoor(door, is_inference)
    count, quick, slow = sample("count"), sample("bucket", le="0.25"), sample("bucket", le="0.5")
    client, server = connection(request({"input": "hello"}))
    assert accept(server, arrived_at=time.monotonic() - 0.3)  # it came 0.3 s ago
    server.close()
    assert answer(client)[0] == "HTTP/1.1 429 Too Many Requests"
    assert sample("count") == count + 1
    assert sample("bucket", le="0.25") == quick and sample("bucket", le="0.5") == slow + 1, "0.3-0.5 s"


def test_what_the_door_at_accept_cannot_read_whole_or_may_let_in_goes_the_usual_way(behind: Arrivals) -> None:
    gate = Gate()
    gate.wait_s = 5.0
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, backlog=behind.backlog, gate=gate)
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


class Verdicts:
    """Stands in for the process's view of each model's admission queue (AdmissionQueue): its held FULL verdicts,
    (model, class) -> the refusal it holds, and each queue: ``room`` calls of a model and class are let in, the
    next refused."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, Priority], QueueFull] = {}
        self.room: dict[tuple[str, Priority], int] = {}
        self.placed: list[tuple[str, Priority, float, float]] = []
        self.late: QueueFull | None = None  # what the gateway says of a call whose turn would come too late
        self.waiting = True  # calls let in on arrival wait for admission

    def forming(self) -> bool:
        return self.waiting

    def place(self, model: str, priority: Priority, timeout_s: float,
              waited_s: float = 0.0) -> QueueFull | Placed:
        self.placed.append((model, priority, timeout_s, waited_s))
        if self.late is not None:
            return self.late
        left = self.room.get((model, priority))
        if left is None:
            return Placed.UNKNOWN
        if left <= 0:
            return QueueFull("the service is full: no room to answer this request within its deadline",
                             retry_after_s=3)
        self.room[model, priority] = left - 1
        return Placed.IN_LINE

    def holds_full(self) -> bool:
        return bool(self.held)

    def held_full(self, model: str, priority: Priority) -> QueueFull | None:
        return self.held.get((model, priority))


def held_door(verdicts: Verdicts, directory: TenantDirectory, auth: str = "none") -> AcceptDoor:
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, backlog=Arrivals().backlog)
    held = QueueShedding(verdicts, directory, Settings.of(auth=auth))  # type: ignore[arg-type]
    return AcceptDoor(door, is_inference, held)


def test_a_call_the_gateway_holds_a_full_verdict_for_is_refused_at_accept_with_that_verdict(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    _store, directory = tenants
    verdicts = Verdicts()
    accept = held_door(verdicts, directory)
    _, idle = connection(request({"input": "hello"}))
    assert not accept(idle)  # no verdict held: the request is not even looked at
    verdicts.held["sim", Priority.INTERACTIVE] = QueueFull("the service is full", retry_after_s=4)
    _, unknown = connection(request({"input": "hello"}))
    assert not accept(unknown)  # the default tenant's class is not known without a query yet: the usual way
    directory.policy("default")
    client, server = connection(request({"input": "hello"}))
    assert accept(server)
    server.close()
    status, headers, body = answer(client)
    assert status == "HTTP/1.1 429 Too Many Requests" and headers["Retry-After"] == "4"
    error = body["error"]
    assert isinstance(error, dict) and error["type"] == "queue_full" and error["message"] == "the service is full"
    assert accept.door.callers.recent("") == 1  # counted as an arrival, as the gateway's refusal would be

    client, server = connection(request({"model": "sim", "messages": []}, path="/v1/chat/completions"))
    assert accept(server)  # the OpenAI shape: the same verdict
    server.close()
    assert answer(client)[2]["error"]["code"] == "queue_full"  # type: ignore[index]


def test_calls_of_another_model_or_class_and_idempotent_retries_go_the_usual_way(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    store, directory = tenants
    verdicts = Verdicts()
    verdicts.held["sim", Priority.INTERACTIVE] = QueueFull("full", retry_after_s=2)
    accept = held_door(verdicts, directory)
    store.set_tenant("nightly", priority="offline")
    for tenant in ("default", "nightly"):
        directory.policy(tenant)
    for data in (request({"input": "hello", "model": "other"}),
                 request({"input": "hello", "priority": "offline"}),
                 request({"input": "hello", "tenant": "nightly"}),  # its tenant is offline
                 request({"input": "hello"}, tenant="nightly"),
                 request({"input": "hello"}, headers={"Idempotency-Key": "k-1"}),  # may be answered from its first call
                 request({"model": "sim", "prompt": "hi", "service_tier": "flex"}, path="/v1/completions"),
                 request({"prompt": "hi"}, path="/v1/completions"),  # no model: its 400 comes the usual way
                 b"POST /v1/infer HTTP/1.1\r\nHost: api\r\nContent-Length: 8\r\n\r\nnot json",
                 b"POST /v1/infer HTTP/1.1\r\nHost: api\r\nContent-Length: 10000\r\n\r\n" + b"[" * 5000 + b"]" * 5000):
        _, server = connection(data)
        assert not accept(server), data
        assert server.recv(65536, socket.MSG_PEEK).startswith(b"POST")  # nothing taken off the socket
    verdicts.held["sim", Priority.OFFLINE] = QueueFull("full", retry_after_s=2)
    _, server = connection(request({"input": "hello"}, tenant="nightly"))
    assert accept(server)


def test_with_keys_a_key_the_index_holds_is_judged_at_accept_by_its_tenants_class(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    """A tenant's key is known on arrival once the process's key index holds it, looked up or not: a tenant quiet
    for longer than the lookups' TTL has its next burst judged as it arrives, by its own class (an offline
    tenant's call is not held to the interactive line's verdict). Any other key, or a key issued since the index
    was loaded, goes the usual way (its 401, or its lookup)."""
    store, directory = tenants
    verdicts = Verdicts()
    verdicts.held["sim", Priority.INTERACTIVE] = QueueFull("full", retry_after_s=2)
    accept = held_door(verdicts, directory, auth="keys")
    _, key = store.create_key("team-a")
    store.set_tenant("batch", priority="offline")
    _, offline_key = store.create_key("batch")
    directory.policy("default")  # without keys this would be known; with keys the key decides
    bad = "Bearer llmb_00000000_" + "x" * 20
    for headers in ({}, {"Authorization": f"Bearer {key}"}, {"Authorization": bad}):
        _, server = connection(request({"input": "hello"}, headers=headers))
        assert not accept(server)  # no key, or one the index does not hold yet: the usual way
    directory.refresh_index()  # as each API process does between calls; no key is looked up
    _, server = connection(request({"input": "hello"}, headers={"Authorization": f"Bearer {key}"}))
    assert accept(server)
    for headers in ({"Authorization": f"Bearer {offline_key}"}, {"Authorization": bad}):
        _, server = connection(request({"input": "hello"}, headers=headers))
        assert not accept(server)  # offline: not the interactive line's verdict; a bad key: its 401


def test_a_light_caller_is_not_held_to_a_floods_full_verdict(tenants: tuple[KeyStore, TenantDirectory]) -> None:
    """The batchers serve tenants fairly, so a steady tenant's call runs ahead of a flood's queue: the flood's
    FULL verdict refuses the flood, not it (the gateway lets it past the model's deadline cap the same way)."""
    store, directory = tenants
    for tenant in ("flood", "steady"):
        store.set_tenant(tenant)
        directory.policy(tenant)
    verdicts = Verdicts()
    verdicts.held["sim", Priority.INTERACTIVE] = QueueFull("the service is full", retry_after_s=2)
    accept = held_door(verdicts, directory)
    for _ in range(50):
        accept.door.callers.arrived("flood")
    accept.door.callers.arrived("steady")
    _, steady = connection(request({"input": "hello"}, tenant="steady"))
    assert not accept(steady)  # the usual way
    client, flood = connection(request({"input": "hello"}, tenant="flood"))
    assert accept(flood)
    flood.close()
    assert answer(client)[2]["error"]["type"] == "queue_full"  # type: ignore[index]


def test_an_arriving_call_is_placed_in_its_line_and_refused_from_its_bytes_beyond_it(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    """As its bytes arrive, a call the door can read is judged by its place in its model's line: let in (and
    counted) while the line has room for it in the time it has left, refused from its bytes beyond it; a call of
    a light caller, or one the door cannot read, goes the usual way without a place."""
    _store, directory = tenants
    directory.policy("default")
    verdicts = Verdicts()
    verdicts.room["sim", Priority.INTERACTIVE] = 2
    accept = held_door(verdicts, directory)
    arrived = time.monotonic() - 1.0  # it arrived a second ago: its deadline counts from then
    for _ in range(2):
        _, server = connection(request({"input": "hello", "timeout_ms": 5000}))
        assert accept(server, arriving=True, arrived_at=arrived) is AtDoor.IN_LINE
        assert server.recv(65536, socket.MSG_PEEK).startswith(b"POST")  # nothing taken off the socket
    model, priority, left_s, waited_s = verdicts.placed[0]
    assert (model, priority) == ("sim", Priority.INTERACTIVE) and 3.9 < left_s <= 4.0 and 1.0 <= waited_s < 1.1
    client, server = connection(request({"input": "hello"}))
    assert accept(server, arriving=True) is AtDoor.REFUSED
    server.close()
    status, headers, body = answer(client)
    assert status == "HTTP/1.1 429 Too Many Requests" and headers["Retry-After"] == "3"
    assert headers["Connection"] == "close" and body["error"]["type"] == "queue_full"  # type: ignore[index]
    assert accept.door.callers.recent("") == 3  # every arrival counted towards who sends what

    placed = len(verdicts.placed)
    _, offline = connection(request({"input": "hello", "priority": "offline"}))
    assert accept(offline, arriving=True) is AtDoor.USUAL  # nothing known of that line: the usual way
    for _ in range(50):
        accept.door.callers.arrived("flood")
    _, light = connection(request({"input": "hello"}, tenant="steady"))
    assert accept(light, arriving=True) is AtDoor.LIGHT  # a light caller is not held to the flood's line
    _, not_json = connection(b"POST /v1/infer HTTP/1.1\r\nHost: api\r\nContent-Length: 8\r\n\r\nnot json")
    assert accept(not_json, arriving=True) is AtDoor.USUAL  # its 400 comes the usual way
    assert len(verdicts.placed) == placed + 1  # the offline call was placed; the others never were

    verdicts.late = Overloaded("this API process would take 2600 ms to get to the request", retry_after_s=2)
    directory.policy("flood")
    client, server = connection(request({"input": "hello"}, tenant="flood"))
    assert accept(server, arriving=True) is AtDoor.REFUSED  # its turn would come past the door's bound
    server.close()
    status, headers, body = answer(client)
    assert status == "HTTP/1.1 429 Too Many Requests" and headers["Retry-After"] == "2"
    assert body["error"]["type"] == "overloaded"  # type: ignore[index]


def test_a_body_a_moment_behind_its_headers_is_placed_on_arrival_all_the_same(
        tenants: tuple[KeyStore, TenantDirectory], monkeypatch: pytest.MonkeyPatch) -> None:
    """Some clients write a request's headers and its body separately: while a line is forming the door looks
    again for a moment rather than letting such a call through unjudged; otherwise the call goes the usual way at
    once, without waiting for its body."""
    _store, directory = tenants
    directory.policy("default")
    verdicts = Verdicts()
    verdicts.room["sim", Priority.INTERACTIVE] = 0
    accept = held_door(verdicts, directory)
    data = request({"input": "hello"})
    head_end = data.index(b"\r\n\r\n") + 4
    client, server = connection(data[:head_end])
    threading.Timer(0.001, client.sendall, args=(data[head_end:],)).start()
    assert accept(server, arriving=True) is AtDoor.REFUSED
    _, partial = connection(request({"input": "hello"}, cut=3))  # the rest never comes: the usual way, soon
    started = time.monotonic()
    assert accept(partial, arriving=True) is AtDoor.USUAL
    assert time.monotonic() - started < 0.5
    verdicts.waiting, placed = False, len(verdicts.placed)  # no line: nothing to count it in
    waits: list[float] = []
    monkeypatch.setattr(accept_door.gevent, "sleep", waits.append)
    _, server = connection(data[:head_end])
    assert accept(server, arriving=True) is AtDoor.USUAL and len(verdicts.placed) == placed
    assert waits == [], "it went on without waiting for its body"
    verdicts.waiting = True
    _, server = connection(data[:head_end])
    assert accept(server, arriving=True) is AtDoor.USUAL and waits == [accept_door.BODY_WAIT_S] * 3


def test_a_call_let_in_by_its_line_is_refused_at_its_turn_only_when_late(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    """Its place was judged when it arrived: at its turn the gate's expected wait does not judge it again, only
    the door's bound on how late the process got to it."""
    _store, directory = tenants
    directory.policy("default")
    gate = Gate()
    gate.wait_s = 5.0
    door = Door(limit=100, retry_after_s=1, max_delay_s=1.0, backlog=Arrivals().backlog, gate=gate)
    accept = AcceptDoor(door, is_inference, QueueShedding(Verdicts(), directory, Settings.of()))  # type: ignore[arg-type]
    _, server = connection(request({"input": "hello"}))
    assert accept(server, 0.5) is AtDoor.REFUSED  # not let in by its line: the expected wait refuses it
    _, server = connection(request({"input": "hello"}))
    assert accept(server, 0.5, in_line=True) is AtDoor.USUAL
    client, server = connection(request({"input": "hello"}))
    assert accept(server, 1.5, in_line=True) is AtDoor.REFUSED
    server.close()
    assert answer(client)[2]["error"]["type"] == "overloaded"  # type: ignore[index]


def test_a_timeout_no_call_may_give_is_left_to_its_400_not_judged_at_accept(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    """Before: the door read the body with Python's json, so ``1e400`` and ``Infinity`` were a timeout of inf and
    the call was given a place in its model's line (its 400 came after). Now the door reads as the body's reader
    does, and a timeout past what any call may give goes the usual way, to its 400."""
    _store, directory = tenants
    directory.policy("default")
    shedding = QueueShedding(Verdicts(), directory, Settings.of(auth="none"))  # type: ignore[arg-type]

    def judged(raw: bytes) -> object:
        return shedding.judged(Peeked("/v1/infer", {}, raw, len(raw)))

    assert judged(b'{"input": "x", "timeout_ms": 5000}') is not None
    for number in (b"1e400", b"Infinity", b"NaN", b"1e308", b"1" + b"0" * 5000):
        assert judged(b'{"input": "x", "timeout_ms": ' + number + b"}") is None, number[:10]


def test_the_worker_hands_the_door_each_requests_arrival_at_accept_on_arrival_and_at_its_turn() -> None:
    """What times a refusal (:meth:`Arrivals.judged`): the accept's time for a just-accepted connection (judged
    as arriving, if its bytes are there); on the connection's greenlet, its first byte's stamp (or the accept, if
    later), both when its bytes arrive and at its turn at intake. A request judged as its connection was accepted
    is not judged again as it arrives: that verdict stands (it counts once in its line)."""
    from webapp import worker

    seen: list[tuple[float | None, bool, float | None, bool, bool]] = []

    class Recording:
        def __call__(self, sock: object, delay: float | None = None, *, arriving: bool = False,
                     arrived_at: float | None = None, in_line: bool = False, at_accept: bool = False) -> AtDoor:
            seen.append((delay, arriving, arrived_at, in_line, at_accept))
            return AtDoor.IN_LINE if arriving else AtDoor.USUAL

        def caller(self, sock: object) -> str:
            return ""

    arrivals = Arrivals()
    arrivals.at_accept = Recording()
    connection = worker._connection  # this greenlet's: what a later test's request here would read as its arrival
    try:
        arrivals.judged(object(), accepted_at=5.0)
        connection.accepted_at, connection.seen_at = 7.0, 7.5  # accepted, then its first byte came
        arrivals.judged(object(), None, True)
        arrivals.judged(object(), 0.3)  # its turn, 0.3 s on: let in by its line on arrival
        connection.accepted_at, connection.seen_at = 9.0, 8.0  # its bytes waited in the listen queue
        arrivals.judged(object(), None, True)
        connection.in_line, connection.placed = False, AtDoor.IN_LINE  # let in by its line as it was accepted
        assert arrivals.judged(object(), None, True) is AtDoor.IN_LINE
        assert connection.in_line and connection.placed is AtDoor.UNSEEN
        arrivals.judged(object(), 0.2)  # its turn: by lateness only, as let in by its line
    finally:
        connection.accepted_at = connection.seen_at = None
        connection.in_line, connection.placed = False, AtDoor.UNSEEN
    assert seen == [(None, True, 5.0, False, True), (None, True, 7.5, False, False), (0.3, False, 7.5, True, False),
                    (None, True, 9.0, False, False), (0.2, False, 9.0, True, False)]


def test_a_condition_on_a_plain_lock_checks_its_owner_without_yielding_to_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gevent's lock, tried without blocking while held, yields to the event loop: everything the process has
    ready runs first. ``threading.Condition`` (behind every ``queue.Queue``: the Redis and broker connection
    pools; and every ``threading.Semaphore``: the gate's slots) tried its plain lock so on every notify and wait,
    to check its caller held it; under a burst each connection given back then waited a pass over the burst's
    arrivals. The API process's worker checks ownership as ``_held`` does: without the attempt."""
    import gevent
    import gevent.thread

    from webapp.worker import _held

    ran: list[str] = []
    lock = gevent.thread.allocate_lock()
    lock.acquire()
    gevent.spawn(ran.append, "ready before the attempt")
    assert not lock.acquire(False) and ran == ["ready before the attempt"], "gevent yielded"
    lock.release()

    condition = threading.Condition(gevent.thread.allocate_lock())
    monkeypatch.setattr(threading.Condition, "_is_owned", _held)
    gevent.spawn(ran.append, "ready before the notify")
    with condition:
        condition.notify()
        assert ran == ["ready before the attempt"], "no yield"
    with pytest.raises(RuntimeError):  # not held: as the attempt would tell
        condition.notify()
    gevent.sleep(0)
    assert ran[-1] == "ready before the notify"

    class Bare:  # a lock-like object with no locked(): asked as the standard library asks
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            return self.lock.acquire(blocking, timeout)

        def release(self) -> None:
            self.lock.release()

        __enter__ = acquire

        def __exit__(self, *exc: object) -> None:
            self.release()

    bare = threading.Condition(Bare())  # type: ignore[arg-type]
    with bare:
        bare.notify()
    with pytest.raises(RuntimeError):
        bare.notify()
