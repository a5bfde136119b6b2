"""The table of OpenAI request fields (webapp.openai_fields), without a stack: every field of OpenAI's chat and
completions requests is in it, and each is handled as it says (honoured fields reach the call's parameters,
accepted ones change nothing, refused and unknown ones are a 400 naming them); ``service_tier``'s echo,
``cached_tokens`` in usage, ``prompt_cache_key`` in the prefix keys, and /openapi.json describing the table."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tasks.config import Settings
from tasks.errors import InvalidInput
from tasks.policy.prefix_routing import item_keys
from tasks.policy.prefixes import CHUNK_CHARS, Option, PrefixIndex, assign, prefix_keys
from tasks.schema import BatchItem, InferenceRequest, Item, ItemResult, Priority, SamplingParams
from tasks.state.records import Record, Shape
from webapp import openapi
from webapp.openai_fields import CHAT, COMPLETIONS, FIELDS, Handling, check, served_tier
from webapp.openai_schema import Streaming, chunk, parse_chat, parse_completion, usage, usage_chunk

# OpenAI's API reference today (openai 3.x's request types), and this service's own fields
OPENAI_CHAT = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
               "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
               "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
               "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
               "top_logprobs", "top_p", "user", "verbosity", "web_search_options"}
OPENAI_COMPLETIONS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                      "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                      "temperature", "top_p", "user"}
OURS = {"timeout_ms", "priority"}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False}}}
# a valid value of each field that is not refused outright (with what it needs beside it)
SAMPLES: dict[str, dict[str, Any]] = {
    "max_tokens": {"max_tokens": 5}, "max_completion_tokens": {"max_completion_tokens": 5},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "stop": {"stop": ["\n"]}, "seed": {"seed": 3},
    "n": {"n": 2}, "presence_penalty": {"presence_penalty": 1.5}, "frequency_penalty": {"frequency_penalty": -0.5},
    "logit_bias": {"logit_bias": {"50256": -100, "15": 2.5}}, "echo": {"echo": True, "max_tokens": 0},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2}, "response_format": {"response_format": {"type": "text"}},
    "tools": {"tools": [TOOL]}, "tool_choice": {"tools": [TOOL], "tool_choice": "auto"},
    "parallel_tool_calls": {"tools": [TOOL], "parallel_tool_calls": False}, "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "service_tier": {"service_tier": "flex"}, "prompt_cache_key": {"prompt_cache_key": "user-42"},
    "prompt_cache_retention": {"prompt_cache_retention": "in_memory"}, "user": {"user": "u1"},
    "safety_identifier": {"safety_identifier": "hash-of-u1"}, "metadata": {"metadata": {"team": "search"}},
    "store": {"store": False}, "modalities": {"modalities": ["text"]}, "best_of": {"best_of": 1},
    "timeout_ms": {"timeout_ms": 5000}, "priority": {"priority": "offline"}}
REFUSED = {"audio": {"format": "wav", "voice": "alloy"}, "modalities": ["text", "audio"],
           "functions": [TOOL["function"]], "function_call": "auto",
           "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
           "web_search_options": {}, "moderation": {}, "prompt_cache_options": {"mode": "explicit"},
           "best_of": 3, "suffix": "end"}


def body(route: str, **fields: Any) -> dict[str, Any]:
    if route == CHAT:
        return {"model": "lm", "messages": [{"role": "user", "content": "hi"}], **fields}
    return {"model": "lm", "prompt": "hi", **fields}


def parse(route: str, given: dict[str, Any]) -> SamplingParams:
    call, _ = (parse_chat if route == CHAT else parse_completion)(given, Settings(), "r1", "t")
    return call.params


def test_every_field_of_openais_requests_and_ours_is_in_the_table() -> None:
    chat = {name for name, field in FIELDS.items() if CHAT in field.routes}
    completions = {name for name, field in FIELDS.items() if COMPLETIONS in field.routes}
    assert chat >= OPENAI_CHAT | OURS and completions >= OPENAI_COMPLETIONS | OURS
    assert chat - OPENAI_CHAT - OURS == set()  # nothing made up
    # chat's fields that completions take too (max_completion_tokens as before; the tier and the routing hint)
    assert completions - OPENAI_COMPLETIONS - OURS == {"max_completion_tokens", "service_tier", "prompt_cache_key",
                                                       "response_format"}
    types = pytest.importorskip("openai.types")  # a newer client's field fails here until it is in the table
    for params, known in ((types.chat.completion_create_params.CompletionCreateParamsBase, chat),
                          (types.completion_create_params.CompletionCreateParamsBase, completions)):
        assert set(params.__annotations__) <= known, set(params.__annotations__) - known


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_each_field_is_handled_as_the_table_says(route: str) -> None:
    plain = parse(route, body(route))
    for name, field in FIELDS.items():
        if route not in field.routes or name in ("model", "messages", "prompt"):
            continue
        if field.handling == Handling.REFUSED:
            with pytest.raises(InvalidInput, match=f"'{name}' is not supported here"):
                parse(route, body(route, **{name: REFUSED[name]}))
            if name not in SAMPLES:
                continue
        parse(route, body(route, **{name: None}))  # null: as absent
        sample = {"logprobs": True if route == CHAT else 2} if name == "logprobs" else SAMPLES[name]
        params = parse(route, body(route, **sample))
        if field.handling == Handling.ACCEPTED:
            assert params == plain, name  # no behaviour here


def test_honoured_fields_reach_the_calls_parameters() -> None:
    params = parse(CHAT, body(CHAT, presence_penalty=1.5, frequency_penalty=-2, logit_bias={"7": -100, "3": 0.5},
                              prompt_cache_key="user-42"))
    assert (params.presence_penalty, params.frequency_penalty) == (1.5, -2.0)
    assert params.logit_bias == ((3, 0.5), (7, -100.0)) and params.prompt_cache_key == "user-42"
    assert parse(COMPLETIONS, body(COMPLETIONS, presence_penalty=0.25)).presence_penalty == 0.25
    # on the wire only when given: an old process reads the rest as before, and passes these on as they came
    wire = json.loads(json.dumps(params.to_dict()))
    assert wire["logit_bias"] == [[3, 0.5], [7, -100.0]] and wire["prompt_cache_key"] == "user-42"
    assert SamplingParams.from_dict(wire) == params
    assert "prompt_cache_key" not in parse(CHAT, body(CHAT)).to_dict()


@pytest.mark.parametrize(("fields", "needle"), [
    ({"foo": 1}, "unknown field 'foo'"),
    ({"foo": None}, "unknown field 'foo'"),
    ({"presence_penalty": 2.5}, "'presence_penalty' must be a number from -2 to 2"),
    ({"frequency_penalty": "1"}, "'frequency_penalty' must be a number from -2 to 2"),
    ({"frequency_penalty": True}, "'frequency_penalty' must be a number"),
    ({"logit_bias": {"5": 101}}, "'logit_bias' must be an object of at most 300 token ids"),
    ({"logit_bias": {"a": 1}}, "'logit_bias' must be"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
    ({"logit_bias": [1]}, "'logit_bias' must be"),
    ({"logit_bias": {"5\n": 1}}, "'logit_bias' must be"),  # ("$" is the very end, as JSON Schema says)
    ({"tools": {"type": "function"}}, "'tools' must be a list of objects"),
    ({"tool_choice": 3}, "'tool_choice' must be a string or an object"),
    ({"response_format": "json"}, "'response_format' must be an object"),
    ({"parallel_tool_calls": "no"}, "'parallel_tool_calls' must be true or false"),
    ({"service_tier": "scale"}, "'service_tier' must be 'auto', 'default', 'flex' or 'priority'"),
    ({"priority": "urgent"}, "'priority' must be 'interactive' or 'offline'"),
    ({"prompt_cache_key": 7}, "'prompt_cache_key' must be a string"),
    ({"prompt_cache_retention": "24h"}, "'prompt_cache_retention' must be 'in_memory'"),
    ({"user": 5}, "'user' must be a string"),
    ({"safety_identifier": "x" * 129}, "'safety_identifier' must be a string of at most 128"),
    ({"metadata": {"k": 1}}, "'metadata' must be an object of at most 16 string values"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "'metadata' must be"),
    ({"store": "yes"}, "'store' must be true or false"),
    ({"best_of": 2}, "'best_of' is a /v1/completions parameter"),
    ({"echo": True}, "'echo' is a /v1/completions parameter"),
    ({"audio": {"voice": "alloy"}}, "'audio' is not supported here: audio output"),
])
def test_a_field_refused_or_out_of_range_is_a_400_naming_it(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse(CHAT, body(CHAT, **fields))
    assert needle in str(refused.value)


def test_completions_refuse_chat_only_fields_and_their_own_refused_ones() -> None:
    for fields, needle in (({"top_logprobs": 2}, "'top_logprobs' is a /v1/chat/completions parameter"),
                           ({"suffix": "x"}, "'suffix' is not supported here"),
                           ({"best_of": 2}, "'best_of' is not supported here"),
                           ({"store": True}, "'store' is a /v1/chat/completions parameter")):
        with pytest.raises(InvalidInput, match=needle):
            check(body(COMPLETIONS, **fields), COMPLETIONS)
    check(body(COMPLETIONS, best_of=1.0, user="u"), COMPLETIONS)  # best_of 1 is what happens anyway


def test_the_answer_says_the_tier_that_served_the_call() -> None:
    assert served_tier({}, Priority.INTERACTIVE) == "" and served_tier(None, Priority.OFFLINE) == ""
    assert [served_tier({"service_tier": t}, Priority.INTERACTIVE) for t in ("auto", "default", "priority", "fast")] \
        == ["default", "default", "priority", "priority"]
    assert served_tier({"service_tier": "flex"}, Priority.OFFLINE) == "flex"
    assert served_tier({"service_tier": "priority"}, Priority.OFFLINE) == "flex"  # its tenant's class is offline
    record = Record(request_id="r", tenant="t", model="m", items=("r.0",), accepted_at=1.0, deadline=2.0,
                    instance="api1", shape=Shape("chat", tier="flex"))
    assert Record.from_json(record.to_json()).shape.tier == "flex"  # a retry and GET /v1/requests say it too
    call = Record(request_id="r", tenant="t", model="m", items=("r.0",), accepted_at=1.0, deadline=2.0,
                  instance="api1")
    assert chunk(call, True, "hi", None, Streaming(tier="flex"))["service_tier"] == "flex"  # each chunk says it
    assert usage_chunk(call, False, (), 1, Streaming(True, "default"))["service_tier"] == "default"
    assert "service_tier" not in chunk(call, True, "hi", None, Streaming())


def test_usage_gives_the_cached_prompt_tokens_of_each_prompt_once() -> None:
    def result(prompt: int, cached: int | None) -> ItemResult:
        output = {"text": "", "finish_reason": "length", "prompt_tokens": prompt, "completion_tokens": 2}
        return ItemResult(output=output if cached is None else {**output, "cached_tokens": cached})

    assert usage((result(10, 8), result(10, 10), result(6, None), result(6, 6)), choices=2) == {
        "prompt_tokens": 16, "completion_tokens": 8, "total_tokens": 24, "prompt_tokens_details": {"cached_tokens": 8}}
    assert usage((result(3, None),))["prompt_tokens_details"] == {"cached_tokens": 0}  # absent: 0, always given


def test_a_prompt_cache_key_names_its_calls_prompt_starts_apart() -> None:
    start = "s" * CHUNK_CHARS * 3
    plain, mine, again, other = (prefix_keys(start), prefix_keys(start, cache_key="u1"),
                                 prefix_keys(start + "more", cache_key="u1"), prefix_keys(start, cache_key="u2"))
    assert len(mine) == len(plain) == 3 and mine == again  # the same key and start: the same names
    assert not set(mine) & set(plain) and not set(mine) & set(other)
    assert prefix_keys(start, cache_key="") == plain  # no key: named as before

    def item(key: str | None) -> BatchItem:
        return BatchItem(id="i", request_id="r", input=start, deadline=9.0, accepted_at=1.0, reply_to="a",
                         params=SamplingParams(max_tokens=4, prompt_cache_key=key))

    assert item_keys(item("u1")) == mine and item_keys(item(None)) == plain
    index = PrefixIndex()
    index.sent("w0", [plain], at=0.0)
    index.sent("w1", [mine], at=0.0)
    options = [Option("w0", 0.0), Option("w1", 0.0)]
    assert assign([item_keys(item("u1")), item_keys(item(None)), item_keys(item("u2"))], options, index) == [1, 0, 0]
    request = InferenceRequest(id="r", tenant="t", model="m", items=(Item("r.0", start),), accepted_at=1.0,
                               deadline=2.0, reply_to="a", params=item("u1").params)
    assert InferenceRequest.from_dict(request.to_dict()).params.prompt_cache_key == "u1"


@pytest.mark.parametrize(("route", "path"), [(CHAT, "/v1/chat/completions"), (COMPLETIONS, "/v1/completions")])
def test_the_api_document_describes_every_field_the_route_takes_and_no_other(route: str, path: str) -> None:
    document = openapi.document("test", Settings())
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["allOf"][0]
    described = {name for name, s in schema["properties"].items() if s != {"type": "null"}}  # (chat: echo null)
    assert described == openapi.documented(route) and schema["additionalProperties"] is False
    for name, field in FIELDS.items():
        if field.schema is not None and route in field.routes:
            assert schema["properties"][name] == {"anyOf": [field.schema, {"type": "null"}]}, name


def test_docs_api_gives_the_table_as_it_is() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    for name, field in FIELDS.items():
        routes = "both" if len(field.routes) == 2 else ("chat" if CHAT in field.routes else "completions")
        assert f"| `{name}` | {routes} | {field.handling.value} | {field.note} |" in text, name


def test_a_sim_lm_worker_names_what_it_caches_under_the_calls_prompt_cache_key() -> None:
    """The worker reports a keyed call's prompt start by the names the batcher gives it (its heartbeat's keys)."""
    from gpu_worker.backends.sim_lm import SimLMBackend

    backend = SimLMBackend(speed=1000)
    try:
        prompt = "Our travel policy, in full. " * 80 + "May I fly?"
        backend.run([prompt], [SamplingParams(max_tokens=2, temperature=0, prompt_cache_key="team-7")])
        held = backend.prefix_cache().keys
        assert prefix_keys(prompt, cache_key="team-7")[0] in held
        assert prefix_keys(prompt)[0] not in held
    finally:
        backend.close()
