"""The message formats: the calls of one round at the door, the one-call body of earlier versions, and generation
parameters as the version before them wrote them (a rolling upgrade runs both)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from gpu_worker.backends.generation import Row
from tasks.broker.queues import request_body, requests_of
from tasks.schema import FORMAT_VERSION, Batch, GenerationOutput, InferenceRequest, Item, SamplingParams


def call(rid: str) -> InferenceRequest:
    return InferenceRequest(id=rid, tenant="t", model="sim", items=(Item(f"{rid}.0", "hello"),), accepted_at=1.0,
                            deadline=5.0, reply_to="r")


def test_a_message_carries_the_calls_of_a_round_and_the_one_call_body_still_reads() -> None:
    calls = [call("a"), call("b")]
    assert requests_of(request_body(calls)) == calls
    assert requests_of(json.dumps(call("old").to_dict())) == [call("old")]  # from an API process not yet upgraded


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"requests": []}', b'{"requests": [{"id": 1}]}',
                                  b'{"requests": 7}', b'"text"'])
def test_a_malformed_message_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError, match="request message"):
        requests_of(body)


def test_a_batch_event_carries_when_it_happened_and_older_workers_events_still_read() -> None:
    from tasks.schema import BatchEvent

    event = BatchEvent("gpu0@h", "b1", "started", at=1_700_000_000.25, idle_ms=12.5)
    assert BatchEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    old = BatchEvent.from_dict({"worker": "gpu0@h", "batch_id": "b1", "event": "started"})
    assert old.at is None and old.idle_ms is None


# -- generation parameters across a rolling upgrade -------------------------------------------------------------
# Messages as the version before typed parameters (e8c5fe7) wrote them, byte for byte: a streamed chat call asking
# for two seeded choices with logprobs, the batch the batcher made of it (choice 1 seeded 9 + 1), an embedding call.
OLD_REQUEST = (
    b'{"id": "r1", "tenant": "t", "model": "lm", "items": [{"id": "r1.0", "input": "[]"}, {"id": "r1.1", "input": '
    b'"[]"}], "accepted_at": 1.0, "deadline": 5.0, "reply_to": "api1", "params": {"max_tokens": 7, "temperature": '
    b'0.0, "top_p": 1.0, "stop": ["a", "b"], "seed": 9, "logprobs": 3, "n": 2, "chat": true, "stream": true}, '
    b'"weight": 1.0, "priority": "interactive"}')
OLD_BATCH = (
    b'{"id": "b1", "model": "lm", "items": [{"id": "r1.0", "request_id": "r1", "input": "[]", "deadline": 5.0, '
    b'"accepted_at": 1.0, "reply_to": "api1", "tenant": "t", "retries": 0, "params": {"max_tokens": 7, '
    b'"temperature": 0.0, "top_p": 1.0, "stop": ["a", "b"], "seed": 9, "logprobs": 3, "n": 2, "chat": true, '
    b'"stream": true}, "died_on": [], "priority": "interactive"}, {"id": "r1.1", "request_id": "r1", "input": "[]", '
    b'"deadline": 5.0, "accepted_at": 1.0, "reply_to": "api1", "tenant": "t", "retries": 0, "params": '
    b'{"max_tokens": 7, "temperature": 0.0, "top_p": 1.0, "stop": ["a", "b"], "seed": 10, "logprobs": 3, "n": 2, '
    b'"chat": true, "stream": true}, "died_on": [], "priority": "interactive"}], "created_at": 2.0, "parent_id": '
    b'null, "attempt": 0}')
OLD_EMBEDDING = (
    b'{"id": "r2", "tenant": "t", "model": "emb", "items": [{"id": "r2.0", "input": "x"}], "accepted_at": 1.0, '
    b'"deadline": 5.0, "reply_to": "api1", "params": {}, "weight": 1.0, "priority": "interactive"}')
# The parameters the old API wrote for these bodies (its webapp.openai_schema, run on them).
OLD_PARSED = [
    ("completions", {"model": "lm", "prompt": "hi"},
     {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "stop": [], "seed": None}),
    ("completions", {"model": "lm", "prompt": ["a", "b"], "n": 3, "seed": 5, "stop": "x", "logprobs": 2,
                     "echo": True, "max_tokens": 0, "temperature": 0.5, "top_p": 0},
     {"max_tokens": 0, "temperature": 0.5, "top_p": 1.0, "stop": ["x"], "seed": 5, "logprobs": 2, "echo": True,
      "n": 3}),
    ("chat", {"model": "lm", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3,
              "temperature": 0, "max_completion_tokens": 7, "stop": ["a", "b"]},
     {"max_tokens": 7, "temperature": 0.0, "top_p": 1.0, "stop": ["a", "b"], "seed": None, "logprobs": 3,
      "chat": True}),
    ("embeddings", {"model": "emb", "input": "x"}, {}),
]


def old_worker_view(params: dict[str, Any]) -> tuple[object, ...]:
    """What the old worker made of a message's params: a copy of its ``Row.from_params`` (by string key, with its
    defaults) and the flags its runner and backends read."""
    stop, max_tokens, logprobs = params.get("stop") or [], params.get("max_tokens"), params.get("logprobs")
    temperature, top_p, seed = params.get("temperature"), params.get("top_p"), params.get("seed")
    return (16 if max_tokens is None else int(max_tokens), [stop] if isinstance(stop, str) else list(stop),
            None if logprobs is None else int(logprobs), bool(params.get("echo")),
            1.0 if temperature is None else float(temperature), float(top_p or 1.0),
            None if seed is None else int(seed), bool(params.get("chat")), bool(params.get("stream")),
            params.get("n", 1))


def new_worker_view(params: SamplingParams) -> tuple[object, ...]:
    row = Row.from_params(0, [], params)
    return (row.max_tokens, row.stop, row.logprobs, row.echo, row.temperature, row.top_p, row.seed, params.chat,
            params.stream, params.n)


@pytest.mark.parametrize("old", [OLD_REQUEST, OLD_EMBEDDING])
def test_an_old_request_message_reads_and_writes_back_the_same(old: bytes) -> None:
    """New code reads what old code wrote, and writes it back with the same keys and values."""
    request = InferenceRequest.from_dict(json.loads(old))
    assert request.to_dict() == {"v": FORMAT_VERSION, **json.loads(old)}  # and its format version
    assert json.loads(request_body([request]))["requests"][0] == {"v": FORMAT_VERSION, **json.loads(old)}
    assert new_worker_view(request.params) == old_worker_view(json.loads(old)["params"])


def test_an_old_batch_message_reads_and_writes_back_the_same() -> None:
    batch = Batch.from_dict(json.loads(OLD_BATCH))
    assert [i.params.seed for i in batch.items] == [9, 10]
    assert json.loads(json.dumps(batch.to_dict())) == {"v": FORMAT_VERSION, **json.loads(OLD_BATCH)}
    for item, old in zip(batch.items, json.loads(OLD_BATCH)["items"]):
        assert new_worker_view(item.params) == old_worker_view(old["params"])


@pytest.mark.parametrize(("route", "body", "old"), OLD_PARSED)
def test_the_new_api_writes_the_params_the_old_one_did_and_an_old_worker_reads_them(
        route: str, body: dict[str, Any], old: dict[str, Any]) -> None:
    """New code writes the old wire form: an old process decodes the message (its ``dict(params)``) and its worker
    reads the same row from it as a new worker does."""
    from tasks.config import Settings
    from webapp.openai_schema import parse_chat, parse_completion, parse_embeddings

    parse = {"completions": parse_completion, "chat": parse_chat, "embeddings": parse_embeddings}[route]
    params = parse(body, Settings(), "r1", "t")[0].params
    wire = json.loads(json.dumps(InferenceRequest(id="r", tenant="t", model="m", items=(Item("r.0", "x"),),
                                                  accepted_at=1.0, deadline=2.0, reply_to="a",
                                                  params=params).to_dict()))["params"]
    assert wire == old and list(wire) == list(old)  # the same keys, in the same order
    assert old_worker_view(dict(wire)) == new_worker_view(SamplingParams.from_dict(wire)) == new_worker_view(params)


def test_keys_of_a_newer_version_are_passed_on_as_they_came() -> None:
    newer = {"max_tokens": 5, "temperature": 1.0, "top_p": 1.0, "stop": [], "seed": None, "min_p": 0.1}
    params = SamplingParams.from_dict(newer)
    assert params.max_tokens == 5 and params.to_dict() == newer


def test_a_generation_output_is_written_as_the_old_result_object() -> None:
    entry = {"token": "a", "logprob": -0.5, "top": [["a", -0.5]]}
    plain = GenerationOutput("hi", "length", 3, 2, token_ids=(1, 2))
    assert plain.to_dict() == {"text": "hi", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2}
    echoed = GenerationOutput("", "length", 1, 0, logprobs=[], prompt="a", prompt_logprobs=[entry])
    assert echoed.to_dict() == {"text": "", "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 0,
                                "logprobs": [], "prompt": "a", "prompt_logprobs": [entry]}
