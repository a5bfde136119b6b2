"""Structured outputs and tools end to end on the real engine (issue 42): hf-causal's continuous engine with the
tests' tiny random model, behind the HTTP API, called by the openai client as an app calls it (retries off).
The model's choices are arbitrary, so what is asserted is what a grammar guarantees whatever the weights: the
parsed object, valid tool calls with their finish reason, and the tool loop's messages through the model's chat
template. Each mechanism is checked more finely without HTTP in test_grammar_hf.py."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from pydantic import BaseModel, Field

if os.environ.get("CI"):  # CI installs the models extra: a missing one is a failure, not a skip
    import torch  # noqa: F401
else:
    pytest.importorskip("torch", reason="bin/test installs the 'models' extra these tests need")

from harness.models import build_tiny_llama
from harness.stack import running_stack

MODEL = "tiny"
ASK = [{"role": "user", "content": "the cat sat on the mat"}]
PLACE = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
         "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "forecast", "parameters": PLACE, "strict": True}},
    {"type": "function", "function": {"name": "clock", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Answer(BaseModel):
    kind: Literal["cat", "mat", "hat"]
    count: int = Field(ge=0, le=99)
    sure: bool


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = Path(tmp_path_factory.mktemp("structured-hf"))
    model = build_tiny_llama(root / MODEL)
    # hf-causal's default mode is the continuous engine, where grammars and tools are honoured
    with running_stack(root / "stack", workers=[(0, {"backend": "hf-causal", "model": str(model)})],
                       web_workers=1) as stack:
        yield openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_gives_the_typed_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(model=MODEL, messages=cast(Any, ASK), response_format=Answer,
                                                   seed=seed, temperature=1.0, max_tokens=100)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Answer), choice.message.content


def test_required_tools_give_valid_calls_and_the_results_go_round_the_loop(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=cast(Any, ASK), tools=cast(Any, TOOLS),
                                           tool_choice="required", parallel_tool_calls=False, seed=1,
                                           temperature=1.0, max_tokens=150)
    answer = first.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    calls = answer.message.tool_calls or []
    assert len(calls) == 1  # one call, as parallel_tool_calls false asks (a random model would write on)
    for call in calls:
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        fn = call.function
        assert call.id.startswith("call_") and fn.name in PARAMS
        jsonschema.validate(json.loads(fn.arguments), PARAMS[fn.name])
    history: list[Any] = [*ASK, answer.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=cast(Any, TOOLS),
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


def test_a_named_tool_is_the_one_called_and_streamed_as_openai_streams_it(client: openai.OpenAI) -> None:
    options: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "seed": 2, "temperature": 1.0,
                               "tool_choice": {"type": "function", "function": {"name": "forecast"}},
                               "parallel_tool_calls": False, "max_tokens": 150}
    whole = client.chat.completions.create(**options)
    assert whole.choices[0].finish_reason == "tool_calls"
    expected = [(c.function.name, json.loads(c.function.arguments))
                for c in whole.choices[0].message.tool_calls or []]
    assert expected and all(name == "forecast" for name, _ in expected)
    streamed: dict[int, dict[str, str]] = {}
    chunks = list(client.chat.completions.create(**options, stream=True))
    for chunk in chunks:
        for entry in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert entry.function is not None
            if entry.id:
                streamed[entry.index] = {"name": entry.function.name or "", "arguments": ""}
            streamed[entry.index]["arguments"] += entry.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == expected
