"""Structured outputs and tools on chat and completions: ``response_format``, ``tools``, ``tool_choice``,
``parallel_tool_calls``, the messages of a tool loop, and answers carrying ``tool_calls`` (no I/O).

A call's ``response_format`` or ``tools`` become a grammar (:mod:`tasks.policy.output_grammar`) that the worker
constrains the row's tokens by; the schemas in them are checked first (:mod:`tasks.policy.json_schema`: OpenAI's
strict subset and limits), and the grammar is compiled once here, so that a schema the worker could not use is a
400 before admission rather than a failed row. ``tool_choice: "none"`` sends no tools to the model at all (its
answer is text, or the ``response_format``), so ``params.tools`` is what says an answer may hold calls.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import llguidance

from tasks.errors import InvalidInput
from tasks.policy import tool_calls, tool_stream
from tasks.policy.json_schema import MAX_SCHEMA_CHARS, SchemaError, check
from tasks.policy.output_grammar import ANY_OBJECT, Function, json_grammar, tools_grammar
from tasks.schema import SamplingParams

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's
ROLES = ("system", "developer", "user", "assistant", "tool")


def constraint(body: dict[str, Any], *, chat: bool) -> tuple[str | None, tuple[dict[str, Any], ...]]:
    """The grammar the body's ``response_format`` and ``tools`` ask for (None: free text), and the tools the
    model is shown (none unless it may call them)."""
    answer = _response_format(body.get("response_format"))
    given = body.get("tools")
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise InvalidInput(f"'{name}' is a /v1/chat/completions parameter")
    functions, tools = _tools(given) if given is not None else ((), ())
    choice, named = _tool_choice(body.get("tool_choice"), functions)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidInput("'parallel_tool_calls' must be true or false")
    if not functions or choice == "none":
        return (None if answer is None else _compiled(json_grammar(answer))), ()
    if named is not None:
        functions = tuple(f for f in functions if f.name == named)
    grammar = tools_grammar(functions, required=choice != "auto", parallel=parallel is not False, answer=answer)
    return _compiled(grammar), tools


def _response_format(value: Any) -> dict[str, Any] | None:
    """The schema the answer must be valid against (None: free text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise InvalidInput("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {...}}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not NAME.fullmatch(spec["name"]):
        raise InvalidInput("'response_format.json_schema' needs a 'name' of 1-64 letters, digits, _ or -")
    if not isinstance(spec.get("strict", False), (bool, type(None))) \
            or not isinstance(spec.get("description", ""), (str, type(None))):
        raise InvalidInput("'response_format.json_schema.strict' must be true or false, and its 'description' "
                           "a string")
    return _schema(spec.get("schema", ANY_OBJECT), bool(spec.get("strict")), "response_format.json_schema.schema")


def _schema(schema: Any, strict: bool, where: str) -> dict[str, Any]:
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise InvalidInput(f"'{where}' is longer than {MAX_SCHEMA_CHARS} characters of JSON")
    try:
        check(schema, strict=strict, where=where)
    except SchemaError as exc:
        raise InvalidInput(f"invalid schema: {exc}") from None
    return dict(schema)


def _tools(given: Any) -> tuple[tuple[Function, ...], tuple[dict[str, Any], ...]]:
    if not isinstance(given, list) or not given or len(given) > MAX_TOOLS:
        raise InvalidInput(f"'tools' must be a list of 1 to {MAX_TOOLS} tools")
    functions: list[Function] = []
    for i, tool in enumerate(given):
        spec = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(spec, dict):
            raise InvalidInput(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}} "
                               "(only function tools are supported)")
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidInput(f"'tools[{i}].function.name' must be 1-64 letters, digits, _ or -")
        if any(f.name == name for f in functions):
            raise InvalidInput(f"'tools' names the function {name!r} twice")
        if not isinstance(spec.get("description", ""), (str, type(None))) \
                or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise InvalidInput(f"'tools[{i}].function': 'description' must be a string, 'strict' true or false")
        params = spec.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        functions.append(Function(name, _schema(params, bool(spec.get("strict")),
                                                f"tools[{i}].function.parameters")))
    return tuple(functions), tuple(given)


def _tool_choice(value: Any, functions: tuple[Function, ...]) -> tuple[str, str | None]:
    """``none``, ``auto`` or ``required``, and the name of the one function the model must call (if named).
    ``auto`` without tools is ``none`` (as vLLM takes it); ``required`` without them is a 400."""
    if value is None or (value == "auto" and not functions):
        return ("auto" if functions else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not functions:
            raise InvalidInput("'tool_choice' 'required' needs 'tools'")
        return str(value), None
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise InvalidInput("'tool_choice' must be 'none', 'auto', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if all(f.name != name for f in functions):
        raise InvalidInput(f"'tool_choice' names the function {name!r}, which is not in 'tools'")
    return "required", name


CACHED_GRAMMAR_CHARS = 64 * 1024  # grammars up to this size are remembered once checked: 256 of them, 16 MiB at most


def _compiled(grammar: str) -> str:
    """The grammar, once llguidance compiled it (a 400 with its message if it cannot). A caller's schemas cannot
    grow the cache past its bound: a larger grammar is checked each time it comes."""
    return _checked_cached(grammar) if len(grammar) <= CACHED_GRAMMAR_CHARS else _checked(grammar)


def _checked(grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    if error:
        raise InvalidInput(f"the schema cannot be compiled to a grammar: {error.splitlines()[0][:500]}")
    return grammar


_checked_cached = lru_cache(maxsize=256)(_checked)


# -- messages ------------------------------------------------------------------------------------------
def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation, checked, as the worker's chat template reads it: each message's role and text content,
    and an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` where they are."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("'messages' must be a non-empty list")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise InvalidInput(f"'messages[{i}]' needs a 'role' ({', '.join(ROLES)})")
    role, calls = m["role"], m.get("tool_calls")
    content = _content(m.get("content"), i, optional=role == "assistant" and bool(calls))
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise _bad(i)
        out["tool_calls"] = [_call(c, i, j) for j, c in enumerate(calls)]
    elif role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise InvalidInput(f"'messages[{i}]': a tool message needs its 'tool_call_id'")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _content(value: Any, i: int, *, optional: bool) -> str | None:
    """A message's text: a string, or a list of text parts (joined); None only where it may be absent."""
    if isinstance(value, str) or (value is None and optional):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise InvalidInput(f"'messages[{i}].content' must be a string or a list of text parts")


def _call(call: Any, i: int, j: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments"), str) or not isinstance(call.get("id"), str):
        raise _bad(i, f".tool_calls[{j}]")
    return {"id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": function["arguments"]}}


def _bad(i: int, where: str = ".tool_calls") -> InvalidInput:
    return InvalidInput(f"'messages[{i}]{where}' must be a list of {{\"id\", \"type\": \"function\", "
                       "\"function\": {\"name\", \"arguments\" (a JSON string)}}}")


# -- answers -------------------------------------------------------------------------------------------
def calls_tools(params: SamplingParams) -> bool:
    """Whether the call's answers may hold tool calls (the model was shown tools)."""
    return bool(params.tools)


def chat_choice(output: dict[str, Any], request_id: str, index: int, tools: bool) -> tuple[dict[str, Any], str]:
    """One chat choice's message and finish_reason: with ``tools``, its calls as ``tool_calls`` (and the text
    outside them, if any, as its content)."""
    text, reason = output["text"], output["finish_reason"]
    parsed = tool_calls.parse(text) if tools else None
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": text}, reason
    calls = [{"id": tool_calls.call_id(request_id, index, k), "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(parsed.calls)]
    message = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
    return message, tool_stream.finish_reason(True, reason)


class StreamedCalls:
    """A streamed chat call's choices as OpenAI streams tool calls (:mod:`tasks.policy.tool_stream`): what a
    client at a stream position holds is the view of the text up to it. A choice resumed part-way, whose text
    before the position this process never saw, gets the rest with its end."""

    def __init__(self, request_id: str, sent: list[int]) -> None:
        self.request_id = request_id
        self.text = {i: "" for i, s in enumerate(sent) if s == 0}  # each choice's text so far, where it is known
        self.views = {i: tool_stream.View("") for i in self.text}

    def delta(self, index: int, sent: int, text: str) -> dict[str, Any] | None:
        """The delta for ``text``, the piece after the first ``sent`` characters (None: held to the end)."""
        known = self.text.get(index)
        if known is None or len(known) != sent:
            self.text.pop(index, None)
            return None
        self.text[index] = known + text
        old, self.views[index] = self.views[index], tool_stream.view(known + text)
        return tool_stream.delta(old, self.views[index], self._ids(index))

    def last(self, index: int, sent: int, output: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The last delta of a finished choice whose client holds its first ``sent`` characters, and its
        finish_reason."""
        text = output["text"]
        final = tool_stream.view(text, final=True)
        piece = tool_stream.delta(tool_stream.view(text[:sent]), final, self._ids(index))
        return piece, tool_stream.finish_reason(bool(final.calls), output["finish_reason"])

    def _ids(self, index: int) -> Callable[[int], str]:
        return lambda k: tool_calls.call_id(self.request_id, index, k)
