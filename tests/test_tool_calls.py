"""The tool-call text form: parsed back into OpenAI's shape, rendered, and given stable ids."""
from __future__ import annotations

import json

from tasks.policy.tool_calls import Parsed, ToolCall, call_id, parse, render


def test_calls_and_content_are_split() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    parsed = parse(text)
    assert parsed.content == "Let me look."
    assert [c.name for c in parsed.calls] == ["weather", "time"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris"}


def test_text_without_calls_is_all_content() -> None:
    assert parse("just words") == Parsed("just words", ())
    assert parse("<tool_call>not json</tool_call>") == Parsed("<tool_call>not json</tool_call>", ())


def test_a_rendered_call_parses_back() -> None:
    call = ToolCall("f", '{"x": [1, 2]}')
    assert parse(render(call)) == Parsed(None, (call,))


def test_ids_are_stable_and_distinct() -> None:
    assert call_id("r1", 0, 0) == call_id("r1", 0, 0)
    assert len({call_id("r1", 0, 0), call_id("r1", 0, 1), call_id("r1", 1, 0), call_id("r2", 0, 0)}) == 4
