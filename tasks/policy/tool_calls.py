"""The text form of a tool call, shared by the web layer (grammar, parsing, streaming) and the workers (chat templates).

A model answers a call with tools in the Hermes form that Qwen, Hermes and most open chat templates use: each call is
``<tool_call>`` + a JSON object ``{"name": ..., "arguments": {...}}`` + ``</tool_call>``, one after another when the
caller allows parallel calls; any text outside the blocks is the message's content. A grammar built by the web layer
makes a constrained row's text keep this form; :func:`parse` turns a finished text back into OpenAI's shape.
Pure: no I/O.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text (as OpenAI sends them)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """A finished answer: its text outside the tool-call blocks (None when there is none) and its calls in order."""

    content: str | None
    calls: tuple[ToolCall, ...]


def parse(text: str) -> Parsed:
    """Split a finished text into content and tool calls; a block that is not a JSON object with a string ``name``
    stays in the content (an unconstrained model may write anything)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        calls.append(call)
        at = m.end()
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return Parsed(content or None, tuple(calls))


def call_object(body: str) -> dict[str, Any] | None:
    """A tool-call block's JSON object, when it is an object with a string ``name`` (None otherwise)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("name"), str) else None


def _call(body: str) -> ToolCall | None:
    value = call_object(body)
    if value is None:
        return None
    arguments = value.get("arguments", {})
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def render(call: ToolCall) -> str:
    """The text of one call, as a model writes it (for an assistant message sent back in a conversation)."""
    return f'{OPEN}\n{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}\n{CLOSE}'


def call_id(request_id: str, choice: int, index: int) -> str:
    """A tool call's id: the same for a call's streamed chunks, its final answer and a stored response."""
    digest = hashlib.blake2b(f"{request_id}/{choice}/{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"
