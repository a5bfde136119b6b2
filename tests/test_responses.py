"""The Responses API end to end with the official `openai` client (retries off, one pooled client) on sim-lm:
create (a string, items, instructions, a chain by previous_response_id), stream, retrieve, delete, input items,
background runs polled, resumed and cancelled, another tenant's 404, and stored responses and background runs that
outlive the API process that took them (SIGKILL)."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agents
import jsonschema
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.stack import Stack, running_stack, wait_for
from tasks.store.models import RequestRecord, make_engine
from tasks.store.responses import ResponseStore

LM = "sim-lm"
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("responses")), workers=[(0, {"backend": "sim-lm"})],
                       web_workers=1, store_inputs="true") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def ledger_input(stack: Stack, request_id: str) -> list[dict[str, Any]]:
    """The chat messages the call ``request_id`` sent its worker, from the ledger (written after the answer)."""
    with Session(make_engine(stack.database_url)) as s:
        query = select(RequestRecord).where(RequestRecord.correlation_id == request_id)
        wait_for(lambda: s.scalars(query).first() is not None, 20, f"the ledger row of {request_id}")
        record = s.scalars(query).first()
        assert record is not None and record.input is not None
        return list(json.loads(record.input))


def test_create_with_instructions_then_retrieve_the_stored_response(client: openai.OpenAI, stack: Stack) -> None:
    raw = client.responses.with_raw_response.create(model=LM, input="the cat sat", instructions="be brief",
                                                    max_output_tokens=8, temperature=0, metadata={"k": "v"})
    r = raw.parse()
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text and r.metadata == {"k": "v"}
    assert r.usage is not None and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert ledger_input(stack, raw.headers["x-request-id"]) == [{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "the cat sat"}]
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # type: ignore[union-attr]


def test_a_chain_by_previous_response_id_sends_the_whole_conversation(client: openai.OpenAI, stack: Stack) -> None:
    first = client.responses.create(model=LM, input=[{"role": "user", "content": "one"}], max_output_tokens=5)
    second = client.responses.with_raw_response.create(model=LM, input="two", previous_response_id=first.id,
                                                       instructions="new rules", max_output_tokens=5)
    assert second.parse().previous_response_id == first.id
    assert ledger_input(stack, second.headers["x-request-id"]) == [
        {"role": "system", "content": "new rules"}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "two"}]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=LM, input="x", previous_response_id="resp_nosuchone")
    unstored = client.responses.create(model=LM, input="x", store=False, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
        "parameters": SCHEMA}


def test_text_format_json_schema_answers_valid_json(client: openai.OpenAI) -> None:
    r = client.responses.create(model=LM, input="a city", max_output_tokens=200,
                                text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA,
                                                 "strict": True}})
    assert r.status == "completed", r.incomplete_details
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_a_function_call_and_its_output_go_round_the_loop(client: openai.OpenAI, stack: Stack) -> None:
    tools: Any = [TOOL]
    r = client.responses.create(model=LM, input="weather in Oslo?", tools=tools, tool_choice="required",
                                max_output_tokens=200)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    assert client.responses.retrieve(r.id).output == r.output
    outputs: Any = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
    follow = client.responses.with_raw_response.create(model=LM, previous_response_id=r.id, input=outputs,
                                                       tools=tools, tool_choice="none", max_output_tokens=5)
    assert follow.parse().output[0].type == "message"
    sent = ledger_input(stack, follow.headers["x-request-id"])
    assert sent[0] == {"role": "user", "content": "weather in Oslo?"}
    assert [t["id"] for t in sent[1]["tool_calls"]] == [c.call_id for c in calls]
    assert sent[2:] == [{"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls]
    # the same conversation as items, without the store
    items: Any = [{"role": "user", "content": "weather in Oslo?"},
                        *({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                          for c in calls), *outputs]
    again = client.responses.with_raw_response.create(model=LM, input=items, store=False, max_output_tokens=5)
    assert ledger_input(stack, again.headers["x-request-id"]) == sent


def test_a_streamed_function_call_sends_its_arguments_as_written(client: openai.OpenAI) -> None:
    tools: Any = [TOOL]
    with client.responses.stream(model=LM, input="weather?", tools=tools, tool_choice="required",
                                 max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls, final.output
    sent = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                   and e.output_index == final.output.index(calls[0]))
    assert sent == calls[0].arguments
    jsonschema.validate(json.loads(sent), SCHEMA)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    stored = client.responses.retrieve(final.id).output
    assert [(getattr(o, "id", None), getattr(o, "arguments", None)) for o in stored] == \
        [(getattr(o, "id", None), getattr(o, "arguments", None)) for o in final.output]


def test_an_agents_sdk_agent_calls_its_function_tool(stack: Stack) -> None:
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(LM, openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused",
                                                               max_retries=0, timeout=TIMEOUT_S))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "weather in Oslo?", max_turns=3)
    assert seen and result.final_output == f"sunny in {seen[0]}"


def test_a_stream_sends_numbered_events_and_stores_its_end(client: openai.OpenAI) -> None:
    # long enough for sim-lm to end by itself (the helper's final response needs response.completed)
    with client.responses.stream(model=LM, input="stream me", max_output_tokens=1000) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_delete_and_another_tenants_404(client: openai.OpenAI, stack: Stack) -> None:
    r = client.responses.create(model=LM, input="mine", max_output_tokens=3)
    other = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S,
                          default_headers={"X-Tenant": "someone-else"})
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def poll(client: openai.OpenAI, response_id: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_background_polled_and_its_stream_resumed(client: openai.OpenAI) -> None:
    r = client.responses.create(model=LM, input="in the background", background=True, max_output_tokens=40)
    assert r.status == "queued" and r.background
    done = poll(client, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    whole = list(client.responses.retrieve(r.id, stream=True))
    assert whole[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    rest = list(client.responses.retrieve(r.id, stream=True, starting_after=3))
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in whole[4:]]


def test_a_background_response_is_cancelled(client: openai.OpenAI) -> None:
    r = client.responses.create(model=LM, input="a long one", background=True, max_output_tokens=1000)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert client.responses.retrieve(r.id).status == cancelled.status


def test_stored_and_background_responses_outlive_the_api_process_that_took_them(client: openai.OpenAI,
                                                                                stack: Stack) -> None:
    url = stack.start_web("web-doomed", workers=1)
    doomed = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    stored = doomed.responses.create(model=LM, input="keep me", max_output_tokens=5)
    running = doomed.responses.create(model=LM, input="run on", background=True, max_output_tokens=600,
                                      temperature=0)
    stack.kill("web-doomed")  # SIGKILL: no thread of it stores anything any more
    left = ResponseStore(make_engine(stack.database_url)).get("default", running.id)
    assert left is not None and not left.final, "it was still running when its process died"
    assert client.responses.retrieve(stored.id).model_dump() == stored.model_dump()
    done = poll(client, running.id)
    assert done.status in ("completed", "incomplete") and done.output_text
