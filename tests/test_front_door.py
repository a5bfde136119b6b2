"""The front door (invariant 8): every body read by one reader, bounded in size and time, decoded strictly;
hostile bodies get a clean 4xx, never a 500; slow bodies 408; the door holds every caller the caps admit and
refuses the excess at once.

Three levels: :func:`webapp.body.parse_json` alone, the Flask app in process (every route kind, the door's
counter), and real gunicorn processes (raw sockets for slow clients, 3,000 connections at once).
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import resource
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client import REGISTRY

from harness.helpers import assert_json_error, expected, post
from harness.stack import BROKER_URL, REDIS_URL, ROOT, Stack, running_stack, wait_for
from tasks.config import Settings
from tasks.errors import InvalidInput, Overloaded, QueueFull, Unavailable
from tasks.gateway.admission_queue import ROOM_ADMITS_PER_S
from tasks.gateway.calls import Call
from tasks.policy.capacity import deadline_cap, full_batches_margin, left_after
from tasks.policy.refusal import FULL_HOLD_S, AdmissionVerdict
from tasks.policy.room import Placed
from tasks.schema import Priority, WorkerInfo
from tasks.state.keys import Keys
from tasks.store.models import ApiKeyRecord, Base, TenantRecord, make_engine
from tasks.store.tenants import KeyStore
from tests.fakes import FakeClock
from webapp import create_app
from webapp.body import parse_json
from webapp.errors import status_of
from webapp.services import services

DEEP_OBJECT = b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"
HOSTILE: dict[str, bytes] = {
    "nested 5,000 deep": DEEP_OBJECT,
    "5,000 open brackets": b"[" * 5000,
    "a million open brackets": b"[" * 1_000_000,
    "a lone high surrogate": rb'{"input": "\ud800"}',
    "a lone low surrogate in a list": rb'{"inputs": ["ok", "\uDC00 alone"]}',
    "a reversed pair": rb'{"input": "\ude00\ud83d"}',
    "a lone surrogate in a key": rb'{"\ud800": "x", "input": "y"}',
    "malformed": b'{"input": "a" "b"}',
    "truncated": b'{"input": "a',
    "not UTF-8": b"\xff\xfe\x00garbage",
    "NaN": b'{"input": "a", "timeout_ms": NaN}',
    "an integer of 5,000 digits": b'{"input": "a", "timeout_ms": ' + b"9" * 5000 + b"}",
    "empty": b"",
}
WRONG: dict[str, Any] = {
    "a list": ["input"],
    "a number for input": {"input": 42},
    "objects in inputs": {"inputs": [{"a": 1}]},
    "101 inputs": {"inputs": ["x"] * 101},
    "100,000 inputs": {"inputs": ["x"] * 100_000},
    "a nested timeout": {"input": "x", "timeout_ms": [[[1]]]},
}


# -- the parser alone -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_bodies_are_invalid_input_with_a_reason(name: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_json(HOSTILE[name])
    assert info.value.message.startswith("the body ")


def test_the_reasons_say_what_is_wrong_and_where() -> None:
    with pytest.raises(InvalidInput, match="not valid JSON: Expecting ',' delimiter at line 1 column 15"):
        parse_json(b'{"input": "a" "b"}')
    with pytest.raises(InvalidInput, match="nested too deeply"):
        parse_json(DEEP_OBJECT)
    with pytest.raises(InvalidInput, match=r"lone UTF-16 surrogate escape \(\\ud800"):
        parse_json(rb'{"input": "\ud800"}')
    with pytest.raises(InvalidInput, match="not UTF-8 text"):
        parse_json(b'{"input": "\xed\xa0\x80"}')  # a surrogate as raw bytes is no UTF-8 either


def test_valid_pairs_nul_and_escaped_backslashes_are_accepted() -> None:
    assert parse_json(rb'{"input": "\ud83d\ude00 \uD83D\uDE00"}') == {"input": "\U0001f600 \U0001f600"}
    assert parse_json(b'{"input": "a\\u0000b"}') == {"input": "a\x00b"}
    assert parse_json(rb'{"input": "\\ud800 is text, not an escape"}') == {"input": "\\ud800 is text, not an escape"}
    assert parse_json(json.dumps({"input": "é" * 1000}, ensure_ascii=False).encode()) == {"input": "é" * 1000}


# -- the app in process: every route reads its body the same way -----------------------------------------------
@pytest.fixture
def app(tmp_path: Path) -> Flask:
    database_url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(database_url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    settings = Settings.from_env(overrides={"auth": "none", "namespace": f"fd{time.monotonic_ns()}",
                                            "database_url": database_url, "max_body_bytes": 16384,
                                            "body_timeout_s": 0.3, "admission_cap": 1, "offline_admission_cap": 1,
                                            "web_workers": 1})
    return create_app(settings)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def _admin_headers(app: Flask) -> dict[str, str]:
    store: KeyStore = services(app).keys
    return {"Authorization": f"Bearer {store.create_key('ops', admin=True)[1]}"}


def _assert_clean(response: Any, status: int, *, openai: bool) -> dict[str, Any]:
    assert response.status_code == status, response.data[:300]
    assert response.headers["Content-Type"].startswith("application/json")
    error: dict[str, Any] = response.get_json()["error"]
    keys = {"message", "type", "param", "code"} if openai else {"message", "type", "request_id"}
    assert set(error) == keys and error["message"] and "Traceback" not in error["message"]
    return error


ROUTES = [("POST", "/v1/infer", False), ("POST", "/v1/completions", True), ("POST", "/v1/chat/completions", True),
          ("POST", "/v1/embeddings", True), ("PUT", "/v1/admin/tenants/team-a", False),
          ("POST", "/v1/admin/keys", False)]


@pytest.mark.parametrize(("method", "path", "openai"), ROUTES)
def test_every_route_answers_hostile_bodies_with_a_clean_4xx(app: Flask, client: FlaskClient, method: str,
                                                             path: str, openai: bool) -> None:
    headers = _admin_headers(app) if "admin" in path else {}
    for name in ("nested 5,000 deep", "a million open brackets", "a lone high surrogate", "malformed", "not UTF-8"):
        body = HOSTILE[name][:16384] if name == "a million open brackets" else HOSTILE[name]
        error = _assert_clean(client.open(path, method=method, data=body, headers=headers), 400, openai=openai)
        assert error["message"].startswith("the body "), (name, error)
    malformed = client.open(path, method=method, data=b'{"input": "a" "b"}', headers=headers)
    assert "Expecting ',' delimiter at line 1 column 15" in malformed.get_json()["error"]["message"]
    error = _assert_clean(client.open(path, method=method, data=b"[" * 20_000, headers=headers), 413, openai=openai)
    assert "16384 bytes" in error["message"]


class SlowStream(io.BytesIO):
    """A request body arriving one byte per ``every_s``, or held until ``release`` is set."""

    def __init__(self, body: bytes, every_s: float = 0.0, release: threading.Event | None = None) -> None:
        super().__init__(body)
        self.every_s = every_s
        self.release = release
        self.reads = 0

    def readinto(self, b: Any) -> int:
        self.reads += 1
        if self.release is not None:
            assert self.release.wait(20), "never released"
        time.sleep(self.every_s)
        data = self.read(1)
        b[:len(data)] = data
        return len(data)


def test_a_slow_body_gets_408_in_process_without_gevent(client: FlaskClient) -> None:
    body = b'{"input": "' + b"x" * 100 + b'"}'
    started = time.monotonic()
    r = client.post("/v1/infer", input_stream=SlowStream(body, every_s=0.02),
                    headers={"Content-Length": str(len(body))})
    elapsed = time.monotonic() - started
    error = _assert_clean(r, 408, openai=False)
    assert error["type"] == "request_timeout" and "0.3 s" in error["message"]
    assert 0.3 <= elapsed < 1.0, elapsed


def test_past_its_share_a_process_refuses_at_once_without_reading_the_body(app: Flask) -> None:
    """admission_cap 1 + offline 1 over one worker process: it holds two requests; the third gets 429 at once."""
    release = threading.Event()
    body = b'{"input": 5}'
    held = [SlowStream(body, release=release) for _ in range(2)]
    answers: list[Any] = []

    def send(stream: SlowStream, path: str) -> None:
        answer = app.test_client().post(path, input_stream=stream, headers={"Content-Length": str(len(body))})
        answer.close()  # as a WSGI server does once the response is sent: the door counts until then
        answers.append(answer)

    threads = [threading.Thread(target=send, args=(s, p)) for s, p in zip(held, ("/v1/infer", "/v1/completions"))]
    for t in threads:
        t.start()
    door = services(app).door
    wait_for(lambda: door.held == 2 and all(s.reads for s in held), 10, "two requests held")
    timed = REGISTRY.get_sample_value("llmb_request_duration_seconds_count", {"status": "429"}) or 0.0
    for path, openai in (("/v1/infer", False), ("/v1/embeddings", True)):
        third = SlowStream(body)
        started = time.monotonic()
        r = app.test_client().post(path, input_stream=third, headers={"Content-Length": str(len(body))})
        error = _assert_clean(r, 429, openai=openai)
        assert time.monotonic() - started < 0.5 and third.reads == 0, "refused before its body was read"
        assert (error["code"] if openai else error["type"]) == "queue_full" and int(r.headers["Retry-After"]) >= 1
    assert REGISTRY.get_sample_value("llmb_request_duration_seconds_count", {"status": "429"}) == timed + 2, \
        "the door's refusals are timed in the latency histogram"
    assert app.test_client().get("/healthz").status_code == 200, "only inference calls are counted"
    release.set()
    for t in threads:
        t.join(10)
    assert sorted(a.status_code for a in answers) == [400, 400]
    assert door.held == 0


def test_a_full_verdict_is_held_for_a_moment_for_the_calls_of_its_model_and_class(app: Flask) -> None:
    """After Redis says a model is full, its calls of that class are refused from memory (and at accept) for
    FULL_HOLD_S, with the verdict's own Retry-After."""
    queue = services(app).queue
    full = QueueFull("the service is full", retry_after_s=2)
    queue.full.hold("sim", Priority.INTERACTIVE, full, time.monotonic())
    held = queue.held_full("sim", Priority.INTERACTIVE)
    assert queue.holds_full() and held is not None and held.retry_after_s == 2
    assert queue.held_full("sim", Priority.OFFLINE) is None
    assert queue.held_full("other", Priority.INTERACTIVE) is None
    queue.full.hold("sim", Priority.INTERACTIVE, full, time.monotonic() - FULL_HOLD_S - 0.001)
    assert not queue.holds_full() and queue.held_full("sim", Priority.INTERACTIVE) is None


def test_a_burst_is_placed_in_its_models_line_by_what_the_fleet_answers_in_time(tmp_path: Path) -> None:
    """The process's view of a model's admission queue (AdmissionQueue.place): calls arriving at once are let in,
    counted for each of the two API processes sharing the load, while the fleet could answer them within their
    time left at their turn (the line shorter by then by what the fleet answers meanwhile); the next is refused
    with the admission script's own refusal. A verdict puts the model's real count in."""
    database_url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(database_url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    app = create_app(Settings.from_env(overrides={"auth": "none", "namespace": f"fd{time.monotonic_ns()}",
                                                  "database_url": database_url, "web_workers": 2}))
    queue = services(app).queue
    assert queue.place("sim", Priority.INTERACTIVE, 5.0) is Placed.UNKNOWN  # no live worker known: the usual way
    workers = [WorkerInfo(id="gpu0@h", queue="q", model="sim", max_batch=100, state="idle", outstanding=0,
                          completed=1, batch_started_at=None, batch_ms_estimate=250.0, heartbeat_at=time.time())]
    queue.workers.last = workers  # one 400/s worker, as the cached view has it
    placed = [queue.place("sim", Priority.INTERACTIVE, 5.0) for _ in range(2000)]
    let_in = placed.count(Placed.IN_LINE)
    assert placed[:let_in] == [Placed.IN_LINE] * let_in  # in arrival order
    refused = placed[let_in]
    assert isinstance(refused, QueueFull) and refused.type == "queue_full" and (refused.retry_after_s or 0) >= 1

    cap, share = queue.settings.admission.cap, queue.settings.admission.queue_share

    def fits(n: int) -> bool:  # the n-th call: 2n ahead (both processes), less what the worker answers by its turn
        turn_s = n / ROOM_ADMITS_PER_S
        at_turn = left_after(2 * n, workers, turn_s)
        # a line deeper than the worker takes (two batches) and a batch beside, until the turn: full batches then
        margin = full_batches_margin(workers, turn_s if at_turn > 300 else 0.0, 2)
        return at_turn + 1 <= deadline_cap(workers, 5.0 - turn_s, cap, share, margin)

    assert fits(let_in - 1) and not fits(let_in)  # all that fit by their turn, and no more
    if_none_answered = next(n for n in range(2000)
                            if 2 * n + 1 > deadline_cap(workers, 5.0 - n / ROOM_ADMITS_PER_S, cap, share))
    assert let_in > 1.2 * if_none_answered  # the worker answers some before the last one's turn
    assert queue.place("sim", Priority.OFFLINE, 5.0) is Placed.IN_LINE  # another class: another line
    shorter = [queue.place("sim", Priority.OFFLINE, 1.5) for _ in range(2000)].count(Placed.IN_LINE)
    assert 0 < shorter < let_in  # less time, less room
    queue.room.decided(("sim", Priority.INTERACTIVE), 0, 400.0)  # a verdict: the model holds nothing after all
    queue.room.ended(("sim", Priority.INTERACTIVE))  # and that call is through admission
    assert queue.room.place(("sim", Priority.INTERACTIVE)) == 2 * (let_in - 1)

    # a call whose turn would come past the door's bound (from its arrival) is refused as the door would then
    turn_s = queue.room.waiting() / ROOM_ADMITS_PER_S  # every call let in goes first; the pace is not measured yet
    bound_s = queue.settings.admission.door_max_delay_s
    late = queue.place("sim", Priority.OFFLINE, 60.0, waited_s=bound_s - turn_s + 0.05)
    assert isinstance(late, Overloaded) and late.type == "overloaded" and late.retry_after_s == math.ceil(turn_s)
    assert queue.place("sim", Priority.OFFLINE, 60.0, waited_s=bound_s - turn_s - 0.05) is Placed.IN_LINE


def test_the_queue_share_sets_how_much_of_a_burst_is_let_in_and_admitted(tmp_path: Path) -> None:
    """LLMB_QUEUE_SHARE: the cap the door places calls against and the one the admission script is given."""
    database_url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(database_url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    workers = [WorkerInfo(id="gpu0@h", queue="q", model="sim", max_batch=100, state="idle", outstanding=0,
                          completed=1, batch_started_at=None, batch_ms_estimate=250.0, heartbeat_at=time.time())]
    let_in, caps = {}, {}
    for share in (0.75, 1.0):
        app = create_app(Settings.from_env(overrides={"auth": "none", "namespace": f"fd{time.monotonic_ns()}",
                                                      "database_url": database_url, "web_workers": 2,
                                                      "queue_share": share}))
        queue = services(app).queue
        queue.workers.last = workers
        placed = [queue.place("sim", Priority.INTERACTIVE, 5.0) for _ in range(2000)]
        let_in[share] = placed.count(Placed.IN_LINE)
        caps[share] = queue.cap_for("sim", 5.0, workers)  # the cap the admission script is given
    assert Settings.from_env().admission.queue_share == 1.0  # the default: a standing line has its own target
    assert caps == {0.75: deadline_cap(workers, 5.0, 10_000, 0.75), 1.0: deadline_cap(workers, 5.0, 10_000, 1.0)}
    assert let_in[1.0] > let_in[0.75] > 0


def standing_queue(tmp_path: Path, **overrides: object) -> tuple[Any, FakeClock, list[WorkerInfo]]:
    """An API process's admission queue on a fake clock, one idle 400/s worker."""
    database_url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(database_url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    clock = FakeClock()
    app = create_app(Settings.from_env(overrides={"auth": "none", "namespace": f"fd{time.monotonic_ns()}",
                                                  "database_url": database_url, "web_workers": 2, **overrides}))
    queue = services(app).queue
    queue.clock = queue.room.clock = queue.standing.clock = queue.deep.clock = clock
    workers = [WorkerInfo(id="gpu0@h", queue="q", model="sim", max_batch=100, state="idle", outstanding=0,
                          completed=1, batch_started_at=None, batch_ms_estimate=250.0, heartbeat_at=time.time())]
    queue.workers.last = workers
    return queue, clock, workers


def stand(queue: Any, clock: FakeClock) -> None:
    """The line fills and does not empty for the interval: it stands."""
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.OK, 1500, None)
    clock.advance(queue.settings.admission.queue_interval_s + 0.1)
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.FULL, 1500, None)


def test_a_new_api_process_warms_up_at_start_so_its_first_burst_does_not_wait_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """gunicorn's worker hook reads the fleet, starts the lease and the result listener and opens broker
    connections (:meth:`Services.warm_up`): a process that had never done so did it in its first burst, behind
    every call of the burst (0.2-0.35 s for the fleet read, 0.09 and 0.15-0.26 s for the two starts, 0.1-0.2 s
    for a connection's first publish, traced). A Redis or RabbitMQ away at start is no failure: the first call
    reads the fleet, or connects, then."""
    from webapp.services import WARM_BROKER_CONNECTIONS, Services

    settings = Settings.of(namespace=f"start-{uuid.uuid4().hex[:8]}", redis_url=REDIS_URL, broker_url=BROKER_URL,
                           database_url=f"sqlite:///{tmp_path / 'llmb.db'}")
    fresh = Services.from_settings(settings)
    fresh.fleet.beat(WorkerInfo(id="gpu0@start", queue="q", model="sim", max_batch=8, state="idle", outstanding=0,
                                completed=1, batch_started_at=None, batch_ms_estimate=10.0,
                                heartbeat_at=fresh.clock()))
    assert fresh.workers.last == []
    fresh.warm_up()
    assert [w.id for w in fresh.workers.last] == ["gpu0@start"]
    # the view is kept fresh with no call coming: the door judges a burst's arrivals by it, from memory
    fresh.fleet.beat(WorkerInfo(id="gpu1@start", queue="q1", model="sim", max_batch=8, state="idle", outstanding=0,
                                completed=1, batch_started_at=None, batch_ms_estimate=10.0,
                                heartbeat_at=fresh.clock()))
    wait_for(lambda: "gpu1@start" in [w.id for w in fresh.workers.last], 10, "the fleet's view kept fresh")
    fresh.stopping.set()
    # the lease is renewed in Redis, and the result listener subscribes to this process's channel
    wait_for(lambda: fresh.client.zscore(fresh.admission.leases_key, fresh.admission.instance) is not None, 10,
             "the process's admission lease")
    replies = Keys.from_settings(settings).replies(fresh.admission.instance)
    wait_for(lambda: dict(fresh.client.pubsub_numsub(replies)).get(replies.encode()) == 1, 10,
             "the result listener's subscription")
    producers = [fresh.publisher.producers.acquire(block=False) for _ in range(WARM_BROKER_CONNECTIONS + 1)]
    try:  # the pool's connections open, each with its channel: a publish on one is its own round trip
        assert [p.connection.connected for p in producers] == [True] * WARM_BROKER_CONNECTIONS + [False]
        assert all(p.connection.default_channel is not None for p in producers[:WARM_BROKER_CONNECTIONS])
    finally:
        for producer in producers:
            producer.release()
        fresh.publisher.close()
    no_broker = Services.from_settings(settings.but(broker_url="amqp://guest:guest@127.0.0.1:1//"))
    monkeypatch.setattr(no_broker.gateway, "start", lambda: None)  # started above, for the fresh process
    with caplog.at_level(logging.INFO, logger="llmb.web"):
        no_broker.warm_up()  # at once, not retrying: the process must start serving (its calls get the 503)
    no_broker.stopping.set()
    assert "RabbitMQ could not be reached at start" in caplog.text
    with no_broker.publisher.producers.acquire(block=False) as producer:
        assert not producer.connection.connected  # nothing half-open left behind: the first publish connects
    no_broker.publisher.close()
    away = Services.from_settings(settings.but(redis_url="redis://127.0.0.1:1/0"))
    started: list[bool] = []
    monkeypatch.setattr(away.gateway, "start", lambda: started.append(True))  # its threads would retry for good
    away.warm_up()
    away.stopping.set()
    assert away.workers.last == [] and started == [True]


def test_a_standing_line_keeps_the_margin_and_a_burst_fills_the_deadline(tmp_path: Path) -> None:
    """LLMB_QUEUE_INTERVAL_MS, LLMB_QUEUE_SHARE, LLMB_QUEUE_STANDING_SHARE at their defaults: a model's line that
    emptied within the interval (a burst into an idle fleet) may fill all the fleet answers before the deadline; one
    that has not emptied for the interval (a steady overload) keeps the 0.75 margin, at the door and in the cap the
    admission script is given, until a count says it emptied."""
    queue, clock, workers = standing_queue(tmp_path)
    admission = queue.settings.admission
    assert (admission.queue_share, admission.queue_standing_share, admission.queue_target_s) == (1.0, 0.75, 0.0)
    burst_cap, standing_cap = (deadline_cap(workers, 5.0, admission.cap, share) for share in (1.0, 0.75))
    full_burst_cap = deadline_cap(workers, 5.0, admission.cap, 1.0, margin_batches=1)  # its batches run full
    assert standing_cap < burst_cap < full_burst_cap
    assert queue.cap_for("sim", 5.0, workers) == burst_cap  # idle: good queue
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.OK, 1500, None)  # a burst fills the line
    clock.advance(admission.queue_interval_s - 0.1)
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.OK, 1500, None)
    assert queue.cap_for("sim", 5.0, workers) == full_burst_cap  # not standing yet
    clock.advance(0.2)
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.FULL, 1500, None)  # never emptied: it stands
    assert queue.cap_for("sim", 5.0, workers) == standing_cap
    clock.advance(1500 / 400)  # nothing admitted meanwhile: the line drains, but only a count says it emptied
    assert queue.cap_for("sim", 5.0, workers) == standing_cap  # (an estimate is no proof: a stalled process's is not)
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.OK, 1, None)  # a verdict counts 1 item ahead
    assert queue.cap_for("sim", 5.0, workers) == burst_cap  # emptied: good queue again


def test_a_deep_lines_cap_keeps_one_batch_time_for_the_batches_running(tmp_path: Path) -> None:
    """LLMB_MAX_OUTSTANDING_BATCHES at its default (2): by the admission script's counts, a model's line deeper than
    its worker takes and a batch beside (300 items) for two batch times has run only full batches, and its cap
    (the door's and the script's) keeps one batch time of margin for them, not two; a count within that depth
    puts the two back at once. The door reckons the same for a call whose turn is that far off, its line that
    deep until then."""
    queue, clock, workers = standing_queue(tmp_path)
    assert queue.settings.worker.max_outstanding_batches == 2
    cap = queue.settings.admission.cap
    two, one = (deadline_cap(workers, 5.0, cap, 1.0, margin_batches=m) for m in (2, 1))
    assert one == two + 100  # a full batch more
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.OK, 301, None)  # just deeper
    assert queue.cap_for("sim", 5.0, workers) == two  # its running batch may be a burst's first few items
    clock.advance(0.49)
    assert queue.cap_for("sim", 5.0, workers) == two
    clock.advance(0.01)
    assert queue.cap_for("sim", 5.0, workers) == one
    queue.decided("sim", Priority.INTERACTIVE, AdmissionVerdict.OK, 300, None)  # no deeper than the worker takes
    assert queue.cap_for("sim", 5.0, workers) == two
    assert queue.cap_for("sim", 5.0, workers, deep_for_s=0.5) == one  # what the door reckons for a later turn


def test_a_standing_line_is_held_to_the_target_when_one_is_set(tmp_path: Path) -> None:
    """LLMB_QUEUE_TARGET_MS set: a standing line admits only what the fleet answers in the target (CoDel's), and
    the door refuses the excess as it arrives; a burst's line is not held to it."""
    queue, clock, workers = standing_queue(tmp_path, queue_target_ms=1000)
    admission = queue.settings.admission
    target_cap = int(400 * admission.queue_target_s)  # what the worker answers in the target delay
    burst_cap = deadline_cap(workers, 5.0, admission.cap, 1.0)
    assert 100 < target_cap < burst_cap
    assert queue.cap_for("sim", 5.0, workers) == burst_cap
    stand(queue, clock)
    assert queue.cap_for("sim", 5.0, workers) == target_cap
    assert queue.cap_for("sim", 0.5, workers) == deadline_cap(workers, 0.5, admission.cap, 0.75)  # never above
    assert isinstance(queue.place("sim", Priority.INTERACTIVE, 5.0), QueueFull)  # refused at the door as well
    clock.advance(1500 / 400)
    assert queue.place("sim", Priority.INTERACTIVE, 5.0) is Placed.IN_LINE  # room under the target: let in


def test_a_call_leaves_the_doors_line_once_only_the_brokers_confirm_is_left(tmp_path: Path) -> None:
    """Admitted, a call gives its turn at the gate up before the broker's confirm (under a broker alarm that
    confirm takes the whole publish timeout), and with it its place in the door's view of the line: a call
    arriving meanwhile is not reckoned to wait for it."""
    database_url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(database_url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    app = create_app(Settings.from_env(overrides={"auth": "none", "namespace": f"fd{time.monotonic_ns()}",
                                                  "database_url": database_url}))
    gateway = services(app).gateway
    assert gateway.gate is not None, "the shipped settings put a gate in front of admission"
    confirming, alarm_over = threading.Event(), threading.Event()

    def confirm_held(prepared: object) -> Unavailable:  # the publish of a blocked broker, until the test ends it
        confirming.set()
        alarm_over.wait(10)
        return Unavailable("the broker blocked publishing (a resource alarm)")

    gateway._publish = confirm_held  # type: ignore[method-assign,assignment]
    gateway._unserved = lambda model: None  # type: ignore[method-assign]  # as if a worker of sim were up
    services(app).queue.room.let_in(("sim", Priority.INTERACTIVE))  # the door let it in as it arrived
    outcome: list[BaseException] = []

    def submit() -> None:
        try:
            gateway.submit(Call(f"r{time.monotonic_ns()}", "t", "sim", ("x",), 5000, received_at=time.monotonic()))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=submit)
    caller.start()
    try:
        assert confirming.wait(10), "the call was admitted and is being published"
        assert services(app).queue.room.waiting() == 0, "through admission: it no longer stands in the door's line"
    finally:
        alarm_over.set()
        caller.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], Unavailable)


def _gunicorn_conf(**env: object) -> dict[str, int]:
    """The settings gunicorn reads from webapp/gunicorn_conf.py (in a process of their own: it raises limits)."""
    code = ("import json, resource, webapp.gunicorn_conf as c; print(json.dumps({'connections': c.worker_connections,"
            " 'backlog': c.backlog, 'fds': resource.getrlimit(resource.RLIMIT_NOFILE)[0], 'wanted': c._fds_wanted}))")
    environ = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LLMB_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=environ | {f"LLMB_{k.upper()}": str(v) for k, v in env.items()})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_gunicorn_holds_a_share_of_both_caps_per_worker_plus_a_margin() -> None:
    default = _gunicorn_conf()  # caps 10,000 + 10,000 over 2 workers
    assert default["connections"] == 10_000 + 1000 and default["backlog"] >= default["connections"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # the soft fd limit is raised to the hard one; with no hard limit, to what the connections need (at least)
    expected = hard if hard != resource.RLIM_INFINITY else max(soft, default["wanted"])
    assert default["fds"] == expected or soft == resource.RLIM_INFINITY == default["fds"], (default, soft, hard)
    assert _gunicorn_conf(admission_cap=1000, offline_admission_cap=501, web_workers=2)["connections"] == 751 + 1000
    assert _gunicorn_conf(web_connections=123) == {**_gunicorn_conf(web_connections=123), "connections": 123}


# -- real gunicorn -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def door_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("door")), web_workers=1, body_timeout_s=1, sim_batch_ms=20) as s:
        yield s


def test_through_gunicorn_hostile_bodies_get_clean_json_and_odd_text_still_works(door_stack: Stack) -> None:
    url = door_stack.url
    for name, body in HOSTILE.items():
        error = assert_json_error(post(url, data=body), 400, "invalid_request")
        assert error["message"].startswith("the body "), (name, error)
    for value in WRONG.values():
        assert_json_error(post(url, value), 400, "invalid_request")
    r = requests.post(url + "/v1/completions", data=DEEP_OBJECT, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text

    big = "é" * 500_000  # 1 MB of UTF-8, within LLMB_MAX_BODY_BYTES
    r = post(url, data=json.dumps({"input": big}, ensure_ascii=False).encode())
    assert r.status_code == 200 and r.json()["output"] == expected(big), r.text[:300]
    for text in ("emoji \U0001f600 as an escaped pair", "nul \x00 inside"):
        r = post(url, {"input": text})  # requests escapes non-ASCII: the emoji goes as \ud83d\ude00
        assert r.status_code == 200 and r.json()["output"] == expected(text), r.text[:300]
    too_big = json.dumps({"input": "é" * 600_000}, ensure_ascii=False).encode()
    assert_json_error(post(url, data=too_big), 413, "payload_too_large")
    chunked = requests.post(url + "/v1/infer", data=iter([b'{"input": "', b"x" * 2_000_000, b'"}']), timeout=30)
    assert_json_error(chunked, 413, "payload_too_large")


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float | None, float | None]:
    """(bytes received, seconds to the first of them, seconds to the close), from now."""
    started = time.monotonic()
    got, first, closed = b"", None, None
    sock.settimeout(0.1)
    while time.monotonic() - started < limit_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            closed = time.monotonic() - started
            break
        if not chunk:
            closed = time.monotonic() - started
            break
        first = first if first is not None else time.monotonic() - started
        got += chunk
    return got, first, closed


def test_a_body_trickling_in_gets_408_at_the_time_limit(door_stack: Stack) -> None:
    sock = _connect(door_stack.url)
    body = b'{"input": "' + b"x" * 200 + b'"}'
    sock.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
    stop = threading.Event()

    def trickle() -> None:
        for byte in body[5:]:
            if stop.wait(0.2):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    got, first, closed = _read_until_closed(sock, 10)
    stop.set()
    sock.close()
    assert first is not None and 0.8 <= first < 3.0, (first, got[:300])
    head, _, payload = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), got[:300]
    error = json.loads(payload)["error"]
    assert error["type"] == "request_timeout" and "within 1 s" in error["message"]
    assert closed is not None and closed < 1 + 5 + 2, "then the connection ends (a lingering close)"


def test_the_door_holds_3000_connections_and_refuses_past_its_share_at_once(tmp_path: Path) -> None:
    """One worker process, caps 1,000 + 500: it holds 1,500 requests (their bodies unfinished) and answers the
    other 1,500 with 429 before their bodies are complete; every one of the 3,000 gets an HTTP answer."""
    total, share = 3000, 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < total + 500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, total * 2), hard))
    # (the delay rule off: this test is about the share; 3,000 connections at once put a process seconds behind)
    with running_stack(tmp_path, workers=(), batchers=0, web_workers=1, admission_cap=1000,
                       offline_admission_cap=500, body_timeout_s=40, door_max_delay_ms=600_000) as stack:
        host, port = stack.url.removeprefix("http://").split(":")
        results = asyncio.run(_hold_connections(host, int(port), total, share))
        log = stack.log("web")
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} connections failed, e.g. {errors[:3]}"
    early = [r for r in results if not isinstance(r, BaseException) and r[0]]
    late = [r for r in results if not isinstance(r, BaseException) and not r[0]]
    assert len(early) == total - share and len(late) == share, (len(early), len(late))
    for _, status, headers, payload in early:
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert json.loads(payload)["error"]["type"] == "queue_full"
    assert {status for _, status, _, _ in late} == {400}, "held, then answered once their bodies came"
    assert "Traceback" not in log


async def _hold_connections(host: str, port: int, total: int, share: int) -> list[Any]:
    body = b'{"input": 5}'
    head = (b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    release = asyncio.Event()
    early = [0]

    async def one() -> tuple[bool, int, dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head + body[:-1])
            await writer.drain()
            answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
            released = asyncio.ensure_future(release.wait())
            done, _ = await asyncio.wait({answer, released}, return_when=asyncio.FIRST_COMPLETED)
            refused_early = answer in done
            released.cancel()
            if refused_early:
                early[0] += 1
            else:
                writer.write(body[-1:])
                await writer.drain()
            lines = (await asyncio.wait_for(answer, 30)).decode().split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
            payload = await reader.readexactly(int(headers["content-length"]))
            return refused_early, int(lines[0].split()[1]), headers, payload
        finally:
            writer.close()

    tasks = [asyncio.ensure_future(one()) for _ in range(total)]
    deadline = time.monotonic() + 40
    while early[0] < total - share and time.monotonic() < deadline and not all(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # no more refusals come once the share is held
    release.set()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def test_a_request_the_process_got_to_too_late_is_refused_before_anything_else() -> None:
    """The door's own queue: past max_delay_s between a connection's accept and its handler, 429 overloaded."""
    from tasks.errors import Overloaded
    from tasks.policy.shedding import Door

    door = Door(limit=10, retry_after_s=1, max_delay_s=1.0, clock=FakeClock(start=100.0))
    door.enter(arrived_at=99.5)
    with pytest.raises(Overloaded) as refused:
        door.enter(arrived_at=98.0)
    assert "2000 ms behind" in refused.value.message and status_of(refused.value.type) == 429
    assert door.held == 1  # a refusal holds nothing
