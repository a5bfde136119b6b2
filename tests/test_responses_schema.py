"""The Responses API without a stack: a body's translation into a chat body, a chat answer as a Response object,
the event stream and its numbering, and the store of responses on SQLite and PostgreSQL (tenancy, bound, expiry)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tasks.errors import DeadlineExceeded, InvalidInput, QuotaExceeded
from tasks.gateway.calls import Delta, Done, Event
from tasks.policy.tool_calls import call_id
from tasks.schema import ItemResult
from tasks.store.models import Base, make_engine
from tasks.store.responses import ResponseStore
from tests.fakes import FakeClock
from webapp.responses_schema import (
    chat_body,
    check_fields,
    input_items,
    new_response_id,
    output_items,
    response_object,
)
from webapp.responses_stream import events, stored_events

RID = "resp_0123456789abcdef"
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}


def result(text: str, finish: str = "stop") -> ItemResult:
    return ItemResult(output={"text": text, "finish_reason": finish, "prompt_tokens": 7, "completion_tokens": 3,
                              "cached_tokens": 4})


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    body = check_fields({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 5,
                         "temperature": 0, "include": [], "truncation": "disabled", "reasoning": None})
    chat = chat_body(body, input_items(body["input"], RID))
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}],
                    "max_completion_tokens": 5, "temperature": 0}


def test_the_routing_hint_and_the_tier_go_on_to_the_chat_call() -> None:
    body = check_fields({"model": "m", "input": "hi", "prompt_cache_key": "user-7", "service_tier": "flex"})
    chat = chat_body(body, input_items(body["input"], RID))
    assert chat["prompt_cache_key"] == "user-7" and chat["service_tier"] == "flex"


def test_unknown_and_unsupported_fields_are_a_400_naming_them() -> None:
    with pytest.raises(InvalidInput, match="'foo'"):
        check_fields({"model": "m", "input": "x", "foo": 1})
    with pytest.raises(InvalidInput, match="'reasoning'"):
        check_fields({"model": "m", "input": "x", "reasoning": {"effort": "high"}})
    with pytest.raises(InvalidInput, match="'background' needs 'store'"):
        check_fields({"model": "m", "input": "x", "background": True, "store": False})
    with pytest.raises(InvalidInput, match="input_text"):
        input_items([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], RID)
    with pytest.raises(InvalidInput, match="hosted tools"):
        chat_body({"model": "m", "tools": [{"type": "web_search"}]}, [])


def test_function_calls_and_their_outputs_become_tool_calls_and_tool_messages() -> None:
    items = input_items([
        {"role": "user", "content": [{"type": "input_text", "text": "weather in Paris and Rome?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
    ], RID)
    assert [i["id"] for i in items][:2] == [f"msg_{RID[5:]}_0", f"msg_{RID[5:]}_1"]
    body = {"model": "m", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False, "text": {"format": {"type": "json_schema", "name": "w", "strict": True,
                                                              "schema": {"type": "object"}}}}
    chat = chat_body(body, items)
    calls = [{"id": f"call_{k}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": c}, separators=(",", ":"))}}
             for k, c in ((1, "Paris"), (2, "Rome"))]
    assert chat["messages"] == [{"role": "user", "content": "weather in Paris and Rome?"},
                                {"role": "assistant", "content": "checking", "tool_calls": calls},
                                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                                {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    assert chat["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in
                                                               ("name", "description", "parameters", "strict")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                                              "strict": True}}


def test_a_tool_call_in_the_text_is_a_function_call_item_with_a_stable_call_id() -> None:
    text = 'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    items = output_items(RID, text, tools=True)
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == "ok"
    assert items[1]["call_id"] == call_id(RID, 0, 0) and json.loads(items[1]["arguments"]) == {"city": "Oslo"}
    assert [i["type"] for i in output_items(RID, text, tools=False)] == ["message"]  # no tools: text as it is


def test_the_response_object_reports_usage_and_a_cut_as_incomplete() -> None:
    body = {"model": "m", "max_output_tokens": 3, "metadata": {"k": "v"}}
    done = response_object(RID, body, 1000.0, "completed", result("abc", "length"))
    assert done["status"] == "incomplete" and done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}
    assert done["object"] == "response" and done["metadata"] == {"k": "v"} and done["store"] is True
    assert done["output"][0]["content"][0]["text"] == "abc"
    assert response_object(RID, body, 1000.0, "completed", result("abc"))["status"] == "completed"


def kinds(stream: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in stream]


def test_events_are_numbered_and_a_resumed_stream_continues_after_the_number_given() -> None:
    calls: list[Event] = [Delta(0, "he", 0), Delta(0, "llo", 2), Done(0, result("hello"))]
    whole = list(events(RID, {"model": "m"}, 1000.0, calls))
    assert kinds(whole) == ["response.created", "response.in_progress", "response.output_item.added",
                            "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                            "response.output_text.done", "response.content_part.done", "response.output_item.done",
                            "response.completed"]
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta") == "hello"
    assert list(events(RID, {"model": "m"}, 1000.0, calls, starting_after=4)) == whole[5:]
    # a piece streamed again (a batch run again) is not sent twice
    again = list(events(RID, {"model": "m"}, 1000.0, [Delta(0, "he", 0), Delta(0, "hel", 0), *calls[1:]]))
    assert "".join(e["delta"] for e in again if e["type"] == "response.output_text.delta") == "hello"


def test_a_streamed_function_call_comes_whole_at_the_end() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ended: list[dict[str, Any]] = []
    stream = list(events(RID, {"model": "m", "tools": [TOOL]}, 1000.0, [Delta(0, text, 0), Done(0, result(text))],
                         on_end=ended.append))
    assert kinds(stream)[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                                 "response.function_call_arguments.done", "response.output_item.done",
                                 "response.completed"]
    assert stream[-2]["item"]["call_id"] == call_id(RID, 0, 0)
    assert ended[0]["output"] == stream[-1]["response"]["output"]
    # in pieces: the arguments stream as they are written, the text before the call as a message
    text = 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces: list[Event] = [Delta(0, text[k:k + 3], k) for k in range(0, len(text), 3)]
    stream = list(events(RID, {"model": "m", "tools": [TOOL]}, 1000.0, [*pieces, Done(0, result(text))]))
    final = stream[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta") == "Let me see."
    arguments = [e["delta"] for e in stream if e["type"] == "response.function_call_arguments.delta"]
    assert len(arguments) > 1 and "".join(arguments) == final["output"][1]["arguments"]
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Oslo"}
    added = [e["output_index"] for e in stream if e["type"] == "response.output_item.added"]
    assert added == [0, 1] and [e["sequence_number"] for e in stream] == list(range(len(stream)))
    failed = list(events(RID, {"model": "m"}, 1000.0, [DeadlineExceeded("too late")]))
    assert kinds(failed)[-2:] == ["error", "response.failed"] and failed[-1]["response"]["error"]["code"]


def test_a_stored_response_replays_its_events() -> None:
    final = response_object(RID, {"model": "m"}, 1000.0, "completed", result("hello"))
    replay = list(stored_events(final, {"model": "m"}, -1))
    assert replay[-1]["response"]["output"] == final["output"] and replay[-1]["type"] == "response.completed"


@pytest.fixture
def store(database_url: str) -> ResponseStore:
    engine = make_engine(database_url)
    Base.metadata.create_all(engine)
    return ResponseStore(engine, FakeClock(1000.0), expire_s=60, tenant_max_count=2)


def save(store: ResponseStore, tenant: str, status: str = "completed") -> str:
    rid = new_response_id()
    body = response_object(rid, {"model": "m"}, store.clock(), status, result("x") if status == "completed" else None)
    store.save(tenant, "req-1", body, {"model": "m"}, [{"type": "message", "id": "m1"}], [{"type": "message"}])
    return rid


def test_the_store_is_per_tenant_bounded_and_expiring(store: ResponseStore) -> None:
    first = save(store, "a")
    found = store.get("a", first)
    assert found is not None and found.final and found.input_items == [{"type": "message", "id": "m1"}]
    assert [i["type"] for i in found.conversation()] == ["message", "message", "message"]
    assert store.get("b", first) is None and not store.delete("b", first), "another tenant's is not found"
    save(store, "a")
    with pytest.raises(QuotaExceeded, match="LLMB_RESPONSES_TENANT_MAX_COUNT"):
        store.check_room("a")
    store.check_room("b")
    assert store.delete("a", first) and store.get("a", first) is None
    store.check_room("a")
    assert isinstance(store.clock, FakeClock)
    store.clock.advance(61)
    assert store.count("a") == 0 and store.delete_expired() == 1


def test_a_final_response_is_not_changed_by_a_late_finisher(store: ResponseStore) -> None:
    rid = save(store, "a", "queued")
    cancelled = response_object(rid, {"model": "m"}, 1000.0, "cancelled")
    assert store.finish("a", rid, cancelled) is not None
    late = store.finish("a", rid, response_object(rid, {"model": "m"}, 1000.0, "completed", result("x")))
    assert late is not None and late.status == "cancelled" and late.body["output"] == []
    assert store.finish("b", rid, cancelled) is None
