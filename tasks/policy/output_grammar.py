"""The grammar that constrains an answer, built from a call's ``response_format`` or its ``tools`` (pure).

The worker constrains a row's tokens by :attr:`tasks.schema.SamplingParams.grammar`, a grammar in llguidance's
Lark syntax (``start: ...``; ``%json {schema}`` embeds a JSON schema). JSON is written compactly with Python's
separators (``", "`` and ``": "``, no other whitespace), so that a model cannot pad an answer with whitespace
until its ``max_tokens`` runs out. Tool calls take the text form of :mod:`tasks.policy.tool_calls`: each
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, the name one of the tools' and the arguments
valid against that function's ``parameters``.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tasks.policy.tool_calls import CLOSE, OPEN

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
FREE_TEXT = r"/[^<](.|\n)*/"  # auto: text that does not begin a tool call (nor any other '<')


@dataclass(frozen=True)
class Function:
    """A function the model may call: its name and its arguments' schema."""

    name: str
    parameters: dict[str, Any]


def json_grammar(schema: dict[str, Any]) -> str:
    """An answer that is one JSON value valid against ``schema``."""
    return f"start: {_json(schema)}\n"


def tools_grammar(functions: Sequence[Function], *, required: bool, parallel: bool,
                  answer: dict[str, Any] | None = None) -> str:
    """An answer of tool calls to ``functions`` (one, or several one after another when ``parallel``); unless
    ``required`` (``tool_choice: auto``), an answer instead: JSON valid against ``answer`` when the call gives a
    ``response_format`` schema, else free text (not empty: an agent reads an empty answer as no answer)."""
    calls = 'call ("\\n" call)*' if parallel else "call"
    start = f"start: {calls}" if required else f"start: answer | {calls}"
    lines = [start,
             f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
             "body: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    lines += [f"fn_{i}: {_json(_call_schema(f))}" for i, f in enumerate(functions)]
    if not required:
        lines.append(f"answer: {FREE_TEXT}" if answer is None else f"answer: {_json(answer)}")
    return "\n".join(lines) + "\n"


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def _call_schema(function: Function) -> dict[str, Any]:
    """The JSON of one call: its name, then its arguments; the parameters' definitions moved to the root, and
    their other references rebased, so that every ``$ref`` still points where it did."""
    params = dict(function.parameters)
    defs: dict[str, Any] = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": _rebased(params)},
            "required": ["name", "arguments"], "additionalProperties": False, **defs}


def _rebased(node: Any) -> Any:
    if isinstance(node, list):
        return [_rebased(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebased(v) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) \
            and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = "#/properties/arguments" + ref[1:]
    return out
