"""Streams that resume: every event carries an SSE id, and a client whose API process dies (or whose connection
drops) gets exactly the events after its last one from any API process, with ``GET /v1/requests/<id>/stream``
and ``Last-Event-ID``. A sim-lm worker, two gunicorns (each one process), pooled clients (requests.Session)."""
from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.stack import Stack, alive, running_stack, wait_for
from tasks.policy.stream_position import BadPosition, Position

LM = "sim-lm"
BODY: dict[str, Any] = {"model": LM, "messages": [{"role": "user", "content": "tell me a long story about the sea"}],
        "max_tokens": 200, "temperature": 0.8, "seed": 7, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def chunk(self) -> dict[str, Any]:
        return json.loads(self.data)


def counts(usage: dict[str, Any]) -> dict[str, Any]:
    """A usage's token counts, less how many prompt tokens the prefix cache held: the same call again may find its
    prompt cached where the first did not."""
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}

def events(response: requests.Response) -> Iterator[Event]:
    """Server-sent events as they arrive (an event ends at a blank line)."""
    event_id: str | None = None
    data: list[str] = []
    for raw in response.iter_lines():
        line = raw.decode()
        if line == "":
            if data:
                yield Event(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])


def text_of(got: list[Event]) -> str:
    return "".join(c["delta"].get("content") or "" for e in got if e.data != "[DONE]"
                   for c in e.chunk["choices"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("resume")), workers=[(0, {"backend": "sim-lm"})],
                       web_workers=1) as s:
        s.other = s.start_web("web2", workers=1)  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[Event]:
    """The same call, streamed without interruption."""
    with requests.Session() as session, session.post(stack.url + "/v1/chat/completions", json=BODY, stream=True,
                                                     timeout=60) as r:
        assert r.status_code == 200
        return list(events(r))


def test_every_event_but_done_carries_its_position(reference: list[Event]) -> None:
    assert reference[-1].data == "[DONE]" and reference[-1].id is None
    ids = [e.id or "" for e in reference[:-1]]
    assert all(ids) and len(set(ids)) == len(ids)
    assert ids[0] == "0" and ids[-1].endswith("fu")  # the role chunk opens it; the usage chunk ends it
    text = text_of(reference)
    assert len(text) > 200 and ids[-2] == f"{len(text)}f"
    sent = 0
    for e in reference[1:-3]:  # each delta's id counts the characters the client has after it
        sent += len(e.chunk["choices"][0]["delta"].get("content") or "")
        assert e.id == str(sent)


def test_a_stream_resumes_on_another_api_process_after_its_own_is_killed(
        stack: Stack, reference: list[Event]) -> None:
    web = stack.children("web")
    assert len(web) == 1
    got: list[Event] = []
    with requests.Session() as session:
        with session.post(stack.url + "/v1/chat/completions", json=BODY, stream=True, timeout=60) as r:
            request_id = r.headers["X-Request-Id"]
            try:
                for e in events(r):
                    got.append(e)
                    if len(got) == 40:  # mid-way through 200 tokens: the API process holding the stream dies
                        os.kill(web[0], signal.SIGKILL)
            except requests.RequestException:
                pass  # the connection died with it
        wait_for(lambda: not alive(web[0]), 10, "the killed API process to be gone")
        assert 40 <= len(got) < len(reference) - 2, "killed mid-way"
        last = got[-1].id
        assert last is not None
        with session.get(f"{stack.other}/v1/requests/{request_id}/stream",  # type: ignore[attr-defined]
                         headers={"Last-Event-ID": last}, stream=True, timeout=60) as r:
            assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            rest = list(events(r))
    assert text_of(got) + text_of(rest) == text_of(reference)  # the same seed: the same text, nothing twice
    assert [e.id for e in got + rest] == [e.id for e in reference]  # every event once, in order, none missing
    assert counts(rest[-2].chunk["usage"]) == counts(reference[-2].chunk["usage"]) and rest[-1].data == "[DONE]"

    # after the end, within the results' TTL: the whole remainder again, and the whole stream from the start
    with requests.Session() as session:
        again = list(events(session.get(f"{stack.url}/v1/requests/{request_id}/stream",
                                         headers={"Last-Event-ID": last}, stream=True, timeout=60)))
        whole = list(events(session.get(f"{stack.url}/v1/requests/{request_id}/stream", stream=True, timeout=60)))
    assert text_of(again) == text_of(rest) and again[-2].id == rest[-2].id
    assert text_of(whole) == text_of(reference) and whole[0].chunk["choices"][0]["delta"]["role"] == "assistant"


def test_a_client_whose_connection_drops_resumes_before_its_generation_is_cancelled(
        stack: Stack, reference: list[Event]) -> None:
    got: list[Event] = []
    with requests.Session() as session:
        with session.post(stack.url + "/v1/chat/completions", json=BODY, stream=True, timeout=60) as r:
            request_id = r.headers["X-Request-Id"]
            for e in events(r):
                got.append(e)
                if len(got) == 20:
                    break  # the client's connection goes: the API process lives on
        last = got[-1].id
        assert last is not None
        with session.get(f"{stack.url}/v1/requests/{request_id}/stream", headers={"Last-Event-ID": last},
                         stream=True, timeout=60) as r:
            rest = list(events(r))
    assert text_of(got) + text_of(rest) == text_of(reference)
    assert rest[-3].chunk["choices"][0]["finish_reason"] == reference[-3].chunk["choices"][0]["finish_reason"]


def test_only_the_calling_tenant_resumes_and_bad_ids_are_refused(stack: Stack) -> None:
    with requests.Session() as session:
        r = session.post(stack.url + "/v1/chat/completions", json={**BODY, "max_tokens": 5},
                         headers={"X-Tenant": "alice"}, timeout=60)
        request_id = r.headers["X-Request-Id"]
        assert r.status_code == 200
        url = f"{stack.url}/v1/requests/{request_id}/stream"
        other = session.get(url, headers={"X-Tenant": "bob"}, timeout=10)
        assert other.status_code == 404 and other.json()["error"]["type"] == "not_found"
        bad = session.get(url, headers={"X-Tenant": "alice", "Last-Event-ID": "1.2.3"}, timeout=10)
        assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]
        mine = session.get(url, headers={"X-Tenant": "alice"}, timeout=10)
        assert mine.status_code == 200 and mine.text.endswith("data: [DONE]\n\n")
        plain = session.post(stack.url + "/v1/chat/completions", json={**BODY, "stream": False, "max_tokens": 3,
                                                                       "stream_options": None}, timeout=60)
        refused = session.get(f"{stack.url}/v1/requests/{plain.headers['X-Request-Id']}/stream", timeout=10)
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "not_resumable"


def test_positions_parse_back_and_refuse_what_no_stream_sent() -> None:
    p = Position.start(3).opened(0).advanced(0, 5).opened(1).finished(1, 9)
    assert str(p) == "5.9f." and Position.parse(str(p), 3) == p
    done = Position.start(1).finished(0, 4).with_usage()
    assert str(done) == "4fu" and Position.parse("4fu", 1) == done
    for bad in ("1.2", "x", "5fu.", "-1", "1e3", "9" * 5000):
        with pytest.raises(BadPosition):
            Position.parse(bad, 1)


def test_a_dropped_stream_is_cancelled_after_the_resume_window_unless_its_client_came_back(stack: Stack) -> None:
    short = stack.start_web("web-short-resume", workers=1, stream_resume_ms=1000)  # the default is tested above
    cancels = stack.redis.pubsub()
    cancels.subscribe(f"{stack.namespace}:cancel")
    long = {**BODY, "max_tokens": 1000}  # about 11 s of decoding: well past the window

    def dropped(session: requests.Session) -> tuple[str, list[str], str]:
        """A stream left after a few events: its request id, its item ids (from its record), its last event id."""
        with session.post(short + "/v1/chat/completions", json=long, stream=True, timeout=60) as r:
            got = []
            for e in events(r):
                got.append(e)
                if len(got) == 5:
                    request_id = r.headers["X-Request-Id"]
                    record = stack.redis.get(f"{stack.namespace}:request:default:{request_id}")
                    assert record is not None
                    return request_id, json.loads(record)["items"], e.id or ""
        raise AssertionError("the stream ended early")

    with requests.Session() as session:
        request_id, mine, last = dropped(session)  # comes back at once: the generation runs on past the window
        with session.get(f"{short}/v1/requests/{request_id}/stream", headers={"Last-Event-ID": last},
                         stream=True, timeout=60) as r:
            rest = list(events(r))
        assert rest[-3].chunk["choices"][0]["finish_reason"] != "cancelled"
        assert rest[-2].chunk["usage"]["completion_tokens"] >= 200, "decoding went on well past the window"
        _, gone, _ = dropped(session)  # does not come back: cancelled once the window passes

    heard: set[str] = set()

    def cancelled() -> bool:
        message = cancels.get_message(timeout=0.5)
        if message and message["type"] == "message":
            heard.update(message["data"].decode().split(","))
        return set(gone) <= heard

    wait_for(cancelled, 15, "the abandoned stream's cancellation")
    assert not set(mine) & heard


def test_a_batch_run_again_or_a_lost_piece_never_repeats_or_skips_text() -> None:
    from tasks.gateway.calls import Delta, Done
    from tasks.schema import ItemResult
    from webapp.openai_schema import Streaming
    from webapp.sse import render

    @dataclass
    class Named:
        request_id: str = "r"
        model: str = "m"

    def run(events: list[Any]) -> tuple[str, list[str]]:
        out = list(render(Named(), True, Streaming(), [{"role": "assistant", "content": ""}], 1, events,
                          Position.start(1)))
        got = [Event(e.split("\n")[0][4:], e.split("data: ")[1].strip()) for e in out[:-1]]
        return text_of(got), [e.id or "" for e in got]

    done = Done(0, ItemResult(output={"text": "Hello world", "finish_reason": "stop"}))
    # the worker was lost after "Hello ": the batch runs again elsewhere and streams its text from the start
    rerun = [Delta(0, "Hello ", 0), Delta(0, "Hello ", 0), Delta(0, "wor", 6), Delta(0, "ld", 9), done]
    assert run(rerun) == ("Hello world", ["0", "6", "9", "11", "11f"])
    # a piece lost on the way (a pub/sub message missed): the rest of the text comes with the last chunk
    lost = [Delta(0, "Hello ", 0), Delta(0, "ld", 9), done]
    assert run(lost) == ("Hello world", ["0", "6", "11f"])


def test_a_process_serves_a_bounded_number_of_resumed_streams_per_tenant() -> None:
    from typing import cast

    from tasks.errors import Overloaded
    from tasks.gateway.resume import MAX_RESUMING_PER_TENANT, Resumer
    from tasks.state.journal import Journal
    from tasks.state.records import Record
    from tasks.state.results import ResultListener
    from webapp.errors import status_of

    class Nothing:  # a journal and a listener with nothing in them
        def read(self, after: object) -> dict[str, object]:
            return {}

        def fetch(self, ids: object) -> dict[str, object]:
            return {}

    resumer = Resumer(cast(Journal, Nothing()), cast(ResultListener, Nothing()), clock=lambda: 1e12)
    record = Record("r", "alice", "sim-lm", ("i",), accepted_at=0.0, deadline=1.0, instance="gone")
    streams = [resumer.events(record, Position.start(1)) for _ in range(MAX_RESUMING_PER_TENANT)]
    assert all(status_of(next(s).type) == 504 for s in streams)  # type: ignore[union-attr]  # running (its deadline long past)
    with pytest.raises(Overloaded):
        resumer.events(record, Position.start(1))
    other = resumer.events(Record("r2", "bob", "sim-lm", ("j",), 0.0, 1.0, "gone"), Position.start(1))
    streams[0].close()  # type: ignore[attr-defined]
    again = resumer.events(record, Position.start(1))  # a place freed: alice may again
    next(again)
    assert other is not None and resumer.resuming["alice"] == MAX_RESUMING_PER_TENANT
