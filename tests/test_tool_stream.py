"""Tool calls streamed as OpenAI streams them: the views of a growing text, their deltas, and the SSE stream of a
chat call with tools, fresh and resumed part-way."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import pytest

from tasks.gateway.calls import Delta, Done
from tasks.policy.stream_position import Position
from tasks.policy.tool_calls import call_id, parse
from tasks.policy.tool_stream import View, delta, view
from tasks.schema import ItemResult
from webapp.openai_schema import Streaming
from webapp.sse import render

TWO_CALLS = ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "at": {"day": 1}}}\n</tool_call>\n'
             '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
TEXTS = [TWO_CALLS, "Plain text, no <b>calls</b>.  ", "Let me check.\n" + TWO_CALLS,
         '<tool_call>\n{"name": "f", "arguments": {"s": "a}b\\"}"}}\n</tool_call>']


def joined(deltas: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str, str]]]:
    """What a client builds of the deltas, as the openai client does: content joined, calls by index."""
    content, calls = "", {}  # type: ignore[var-annotated]
    for d in deltas:
        content += d.get("content", "")
        for entry in d.get("tool_calls", []):
            got = calls.setdefault(entry["index"], {"id": "", "name": "", "arguments": ""})
            got["id"] += entry.get("id", "")
            got["name"] += entry.get("function", {}).get("name", "")
            got["arguments"] += entry["function"].get("arguments", "")
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def ids(index: int) -> str:
    return call_id("r", 0, index)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_character_by_character_make_the_whole_answer(text: str) -> None:
    views = [view(text[:n]) for n in range(len(text) + 1)] + [view(text, final=True)]
    deltas = [delta(a, b, ids) for a, b in itertools.pairwise(views)]
    content, calls = joined(deltas)
    parsed = parse(text)
    assert (content or None) == (parsed.content.strip() if parsed.calls and parsed.content else parsed.content)
    assert [(name, json.loads(args)) for _, name, args in calls] \
        == [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    assert [i for i, _, _ in calls] == [ids(k) for k in range(len(calls))]
    for a, b in itertools.pairwise(views):  # each view extends the one before
        assert b.content.startswith(a.content) and len(b.calls) >= len(a.calls)
        assert all(y.name == x.name and y.arguments.startswith(x.arguments) for x, y in zip(a.calls, b.calls,
                                                                                            strict=False))


def test_a_call_opens_with_its_name_and_empty_arguments_then_fragments() -> None:
    head = '<tool_call>\n{"name": "weather", "arguments": '
    first = delta(View(""), view(head), ids)
    assert first == {"tool_calls": [{"index": 0, "id": ids(0), "type": "function",
                                     "function": {"name": "weather", "arguments": ""}}]}
    assert delta(view(head), view(head + '{"city": "Os'), ids) \
        == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Os'}}]}
    assert view("Hello <tool_ca") == View("Hello")  # what may begin a call is held back


@dataclass
class Named:
    request_id: str = "r"
    model: str = "m"


def stream(events: list[Any], position: Position) -> list[dict[str, Any]]:
    out = render(Named(), True, Streaming(), [{"role": "assistant", "content": ""}], 1, events, position,
                 tools=True)
    return [json.loads(e.split("data: ")[1]) for e in out if "[DONE]" not in e]


def test_a_streamed_chat_with_tools_sends_call_deltas_and_finish_reason_tool_calls() -> None:
    text = "Let me check.\n" + TWO_CALLS
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    events: list[Any] = [Delta(0, p, 7 * i) for i, p in enumerate(pieces)]
    events.append(Done(0, ItemResult(output={"text": text, "finish_reason": "stop"})))
    chunks = stream(events, Position.start(1))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content, calls = joined(deltas[1:])
    assert content == "Let me check."
    assert [(n, json.loads(a)) for _, n, a in calls] == [("weather", {"city": "Oslo", "at": {"day": 1}}),
                                                         ("time", {})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # resumed part-way, in a process that never saw the text before the position: the rest with the end
    middle = 40
    resumed = stream([Delta(0, text[middle:], middle), events[-1]], Position.parse(f"{middle}", 1))
    assert len(resumed) == 1 and resumed[0]["choices"][0]["finish_reason"] == "tool_calls"
    before = [view(text[:middle])]
    assert joined([delta(View(""), before[0], ids), resumed[0]["choices"][0]["delta"]])[1] \
        == [(call_id("r", 0, k), n, a) for k, (_, n, a) in enumerate(calls)]


def test_a_call_cut_by_length_keeps_finish_reason_length() -> None:
    text = '<tool_call>\n{"name": "time", "arguments": {"zone": "U'
    chunks = stream([Delta(0, text, 0), Done(0, ItemResult(output={"text": text, "finish_reason": "length"}))],
                    Position.start(1))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert joined([c["choices"][0]["delta"] for c in chunks[1:]])[1] == [(ids(0), "time", '{"zone": "U')]
