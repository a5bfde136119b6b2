"""Structured outputs and tools with the clients people run, unchanged, against the real system on sim-lm with
retries off: the openai client (``.parse`` with a Pydantic model, JSON mode, tools required, named, auto and none,
streamed, a tool loop, a bad schema), LangChain (``with_structured_output(method="json_schema")``, ``bind_tools``
and a tool loop), LiteLLM (tools), pydantic-ai (an agent with a structured ``output_type``) and the OpenAI Agents
SDK (an agent with a function tool on its chat-completions model). sim-lm's constrained rows follow the grammar
the web layer built, so every answer must parse and validate, whatever words it holds.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

import jsonschema
import pytest
import requests
from pydantic import BaseModel

from harness.stack import Stack, running_stack
from tests.test_stream_resume import Event, events

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before litellm is imported: no fetch of the cost map

if os.environ.get("CI"):  # CI installs the test extra: a missing client is a failure, not a skip
    import agents
    import langchain_core.messages as lc_messages
    import langchain_openai
    import litellm
    import openai
    import pydantic_ai
    import pydantic_ai.models.openai as pai_openai
    import pydantic_ai.providers.openai as pai_providers
else:
    agents = pytest.importorskip("agents", reason="bin/test installs the 'test' extra")
    langchain_openai = pytest.importorskip("langchain_openai", reason="bin/test installs the 'test' extra")
    lc_messages = pytest.importorskip("langchain_core.messages", reason="bin/test installs the 'test' extra")
    litellm = pytest.importorskip("litellm", reason="bin/test installs the 'test' extra")
    openai = pytest.importorskip("openai", reason="bin/test installs the 'test' extra")
    pydantic_ai = pytest.importorskip("pydantic_ai", reason="bin/test installs the 'test' extra")
    pai_openai = pytest.importorskip("pydantic_ai.models.openai", reason="bin/test installs the 'test' extra")
    pai_providers = pytest.importorskip("pydantic_ai.providers.openai", reason="bin/test installs the 'test' extra")

LM = "sim-lm"
TIMEOUT_S = 60
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                   "days": {"type": "integer"}},
                  "required": ["city", "days"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                      "parameters": WEATHER_PARAMS, "strict": True}},
    {"type": "function", "function": {"name": "clock", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {}}}}]
PARAMS = {"weather": WEATHER_PARAMS, "clock": {"type": "object", "properties": {}}}
ASK: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


class Pet(BaseModel):
    name: str
    legs: int


class Person(BaseModel):
    name: str
    age: int | None
    favourite: Color
    pets: list[Pet]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("structured")), workers=[(0, {"backend": "sim-lm"})],
                       web_workers=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def valid_calls(message: Any, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """The message's tool calls as (name, arguments), each checked against its function's parameters."""
    calls = []
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


# -- the openai client ----------------------------------------------------------------------------------------
def test_parse_with_a_pydantic_model_gives_the_typed_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(model=LM, messages=ASK, response_format=Person, seed=seed,
                                                   max_tokens=400)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person), choice.message.content


def test_json_mode_gives_a_json_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=LM, messages=ASK, response_format={"type": "json_object"},
                                                max_tokens=300)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)


def test_a_json_schema_on_completions_constrains_the_text(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    completion = client.completions.create(model=LM, prompt="Answer:", max_tokens=100, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize(("choice", "names"), [("required", {"weather", "clock"}),
                                               ({"type": "function", "function": {"name": "weather"}}, {"weather"})])
def test_tools_required_or_named_give_valid_tool_calls(client: openai.OpenAI, choice: Any, names: set[str]) -> None:
    completion = client.chat.completions.create(model=LM, messages=ASK, tools=cast(Any, TOOLS),
                                                tool_choice=choice, max_tokens=200)
    answer = completion.choices[0]
    assert answer.finish_reason == "tool_calls"
    assert valid_calls(answer.message, names)


def test_one_call_without_parallel_calls_and_none_gives_text(client: openai.OpenAI) -> None:
    for seed in range(4):
        single = client.chat.completions.create(model=LM, messages=ASK, tools=cast(Any, TOOLS), seed=seed,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=200)
        assert len(valid_calls(single.choices[0].message, {"weather", "clock"})) == 1
    none = client.chat.completions.create(model=LM, messages=ASK, tools=cast(Any, TOOLS), tool_choice="none",
                                          max_tokens=20)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    assert none.choices[0].finish_reason in ("stop", "length")


def test_auto_gives_text_or_valid_calls(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.create(model=LM, messages=ASK, tools=cast(Any, TOOLS), seed=seed,
                                                    max_tokens=60)
        answer = completion.choices[0]
        if answer.message.tool_calls:
            assert answer.finish_reason == "tool_calls" and valid_calls(answer.message, {"weather", "clock"})
        else:
            assert answer.message.content is not None and "<tool_call>" not in answer.message.content


def test_streamed_tool_calls_are_the_same_calls_as_without_stream(client: openai.OpenAI) -> None:
    options: dict[str, Any] = {"model": LM, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 3,
                               "max_tokens": 200}
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(**options, stream=True))
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for entry in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if entry.id:  # a call's first delta: its index, id, type and name, as OpenAI streams them
                assert entry.index not in calls and entry.type == "function" and entry.function is not None
                calls[entry.index] = {"id": entry.id, "name": entry.function.name or "", "arguments": ""}
            assert entry.function is not None
            calls[entry.index]["arguments"] += entry.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    expected = whole.choices[0].message.tool_calls or []
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in expected]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_tool_loop_sends_the_results_back(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=LM, messages=ASK, tools=cast(Any, TOOLS), tool_choice="required",
                                           max_tokens=200)
    message = first.choices[0].message
    valid_calls(message, {"weather", "clock"})
    history: list[Any] = [*ASK, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in message.tool_calls or []]
    second = client.chat.completions.create(model=LM, messages=history, tools=cast(Any, TOOLS), tool_choice="none",
                                            max_tokens=20)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None


def test_a_bad_schema_is_a_400_naming_the_keyword(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 3}}, "required": ["name"],
              "additionalProperties": False}
    with pytest.raises(openai.BadRequestError, match="minLength"):
        client.chat.completions.create(model=LM, messages=ASK, response_format=cast(Any, {
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}))
    loose = {"type": "object", "properties": {"name": {"type": "string"}}}
    with pytest.raises(openai.BadRequestError, match="additionalProperties"):
        client.chat.completions.create(model=LM, messages=ASK, tools=cast(Any, [
            {"type": "function", "function": {"name": "f", "parameters": loose, "strict": True}}]))


# -- LangChain, LiteLLM ---------------------------------------------------------------------------------------
def chat_model(stack: Stack, **options: Any) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(model=LM, base_url=stack.url + "/v1", api_key=cast(Any, "unused"),
                                       max_retries=0, timeout=TIMEOUT_S, use_responses_api=False, **options)


def test_langchain_structured_output_and_a_tool_loop(stack: Stack) -> None:
    person = chat_model(stack, max_tokens=400).with_structured_output(Person, method="json_schema")
    assert isinstance(person.invoke("Describe a person"), Person)

    def weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        return f"sunny in {city} for {days} days"

    llm = chat_model(stack, max_tokens=200)
    messages: list[Any] = [lc_messages.HumanMessage("What is the weather in Oslo?")]
    asked = llm.bind_tools([weather], tool_choice="weather", strict=True).invoke(messages)
    assert isinstance(asked, lc_messages.AIMessage) and asked.tool_calls, asked
    messages.append(asked)
    for call in asked.tool_calls:
        assert call["name"] == "weather" and set(call["args"]) == {"city", "days"}
        messages.append(lc_messages.ToolMessage(weather(**call["args"]), tool_call_id=call["id"]))
    answer = llm.bind_tools([weather], tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


def test_litellm_with_tools(stack: Stack) -> None:
    response = litellm.completion(model=f"openai/{LM}", messages=ASK, tools=TOOLS, tool_choice="required",
                                  max_tokens=200, api_base=stack.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                                  max_retries=0, num_retries=0)
    choice = cast(Any, response).choices[0]
    assert choice.finish_reason == "tool_calls"
    valid_calls(choice.message, {"weather", "clock"})


# -- agents ---------------------------------------------------------------------------------------------------
def test_a_pydantic_ai_agent_with_a_structured_output_type(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    provider = pai_providers.OpenAIProvider(openai_client=client)
    model = pai_openai.OpenAIChatModel(LM, provider=provider)
    agent = pydantic_ai.Agent(model, output_type=Person, retries=0,
                              model_settings={"max_tokens": 400})
    result = agent.run_sync("Describe a person")
    assert isinstance(result.output, Person)


def test_an_openai_agents_sdk_agent_calls_its_function_tool(stack: Stack) -> None:
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    agent = agents.Agent(name="forecaster", instructions="Answer with the weather.", tools=[weather],
                         model=agents.OpenAIChatCompletionsModel(model=LM, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120))
    result = agents.Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=4)
    assert called, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output


# -- a stream of tool calls again ----------------------------------------------------------------------------
def called(got: list[Event]) -> list[tuple[str, str, Any]]:
    """The calls a client builds of a stream's tool-call deltas: (id, name, arguments)."""
    calls: dict[int, dict[str, str]] = {}
    for event in got:
        for choice in event.chunk["choices"] if event.data != "[DONE]" else []:
            for entry in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(entry["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] += entry.get("id", "")
                call["name"] += entry["function"].get("name", "")
                call["arguments"] += entry["function"].get("arguments", "")
    return [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_a_streamed_tool_call_resumed_and_read_again_is_the_same_call(stack: Stack) -> None:
    body = {"model": LM, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 11, "max_tokens": 200,
            "stream": True}
    with requests.Session() as session:
        with session.post(stack.url + "/v1/chat/completions", json=body, stream=True, timeout=TIMEOUT_S) as r:
            assert r.status_code == 200
            got = list(events(r))
        request_id = got[0].chunk["id"].split("-", 1)[1]
        whole = called(got)
        assert whole and got[-2].chunk["choices"][0]["finish_reason"] == "tool_calls"
        for cut in (1, len(got) // 2, len(got) - 2):  # resumed after the role chunk, mid-way, before the last
            last = got[cut - 1].id
            assert last is not None
            with session.get(f"{stack.url}/v1/requests/{request_id}/stream", headers={"Last-Event-ID": last},
                             stream=True, timeout=TIMEOUT_S) as r:
                rest = list(events(r))
            assert called(got[:cut] + rest) == whole, cut
        again = session.get(f"{stack.url}/v1/requests/{request_id}", timeout=TIMEOUT_S).json()
    choice = again["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == whole
