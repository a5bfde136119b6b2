"""The Responses API (``/v1/responses``) as a chat call, and a chat answer as a Response object; pure, no I/O.

A Responses body is translated into the chat-completions body it means (:func:`chat_body`): its ``input`` items
(messages, ``function_call`` and ``function_call_output`` items) become chat messages (an assistant message
with ``tool_calls``, ``tool`` messages), ``instructions`` the system message, ``text.format`` the
``response_format``, the flat function tools the chat's nested ones. That body then goes through the chat
route's own parser (:func:`webapp.openai_schema.parse_chat`), so both routes check and constrain alike. The
chat answer's text comes back as output items (:func:`output_items`): a ``message`` with ``output_text``, and a
``function_call`` per tool call in it (:mod:`tasks.policy.tool_calls`), whose ``call_id`` is derived from the
response's id, so a streamed, a finished and a stored response name the same calls.

``previous_response_id`` is resolved by the store: the earlier response's conversation (its history, its input
and its output items, function calls included) goes before this input (:func:`conversation`).
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

from tasks.errors import InvalidInput
from tasks.policy import tool_stream
from tasks.policy.tool_calls import call_id
from tasks.schema import ItemResult

# Fields taken as OpenAI defines them; anything else is a 400 naming it (never silently ignored).
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "text", "metadata", "store", "previous_response_id", "stream", "background",
          "user", "safety_identifier", "prompt_cache_key", "service_tier", "timeout_ms", "priority", "seed"}
# Fields clients send with a value that means "nothing asked" (the Agents SDK sends several): accepted only so.
NEUTRAL: dict[str, tuple[Any, ...]] = {"include": (None, []), "reasoning": (None, {}), "truncation": (None, "disabled"),
                                       "prompt": (None,), "conversation": (None,), "top_logprobs": (None, 0),
                                       "max_tool_calls": (None,), "stream_options": (None, {})}
CHAT_NAMES = {"max_output_tokens": "max_completion_tokens"}  # a Responses field under its chat name
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def new_response_id(now: float | None = None) -> str:
    """``resp_`` + time-ordered hex (listing and expiry sort by it)."""
    return f"resp_{int((time.time() if now is None else now) * 1000):012x}{secrets.token_hex(12)}"


def check_fields(body: Any) -> dict[str, Any]:
    """The body, once every field is known and of its type (a 400 naming the first that is not)."""
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    _known(body)
    _metadata(body.get("metadata"))
    _types(body)
    if body.get("background") and body.get("store") is False:
        raise InvalidInput("'background' needs 'store': a background response is read back from the store")
    return body


def _neutral(name: str, value: Any) -> bool:
    """Whether ``value`` is one of the values of ``name`` that ask for nothing (``false`` is not ``0``: JSON's
    booleans are no numbers, though Python's are)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in NEUTRAL[name])


def _known(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in FIELDS or (name in NEUTRAL and _neutral(name, value)):
            continue
        if name in NEUTRAL:
            raise InvalidInput(f"'{name}' is not supported here (only {NEUTRAL[name][0]!r} or "
                               f"{NEUTRAL[name][-1]!r})")
        raise InvalidInput(f"unknown field '{name}': /v1/responses takes {', '.join(sorted(FIELDS))}")


def _metadata(meta: Any) -> None:
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items())):
        raise InvalidInput("'metadata' must be an object of at most 16 string values (keys up to 64 characters, "
                           "values up to 512)")


def _types(body: dict[str, Any]) -> None:
    kinds: tuple[tuple[str, type, str], ...] = (
        *((name, bool, "true or false") for name in ("store", "stream", "background", "parallel_tool_calls")),
        *((name, str, "a string") for name in ("instructions", "previous_response_id", "user", "safety_identifier",
                                               "prompt_cache_key")),
        ("tools", list, "a list"), ("text", dict, "an object"))
    for name, kind, words in kinds:
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise InvalidInput(f"'{name}' must be {words}")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)):
        raise InvalidInput("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}")


# -- input items -------------------------------------------------------------------------------------------
def input_items(value: Any, response_id: str) -> list[dict[str, Any]]:
    """The body's ``input`` as a list of items, each with an id (a string is one user message)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidInput("'input' must be a string or a non-empty list of items")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidInput(f"'input[{i}]' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            clean = {"type": "message", "role": item.get("role"), "content": _content(item.get("content"), i)}
            if clean["role"] not in ("user", "system", "developer", "assistant"):
                raise InvalidInput(f"'input[{i}].role' must be user, system, developer or assistant")
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise InvalidInput(f"'input[{i}]': a function_call item needs string 'call_id', 'name', 'arguments'")
            clean = {"type": kind, "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
                     "status": "completed"}
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise InvalidInput(f"'input[{i}]': a function_call_output item needs a string 'call_id' and 'output'")
            clean = {"type": kind, "call_id": item["call_id"], "output": output, "status": "completed"}
        else:
            raise InvalidInput(f"'input[{i}].type' {kind!r} is not supported (message, function_call, "
                               "function_call_output)")
        clean["id"] = item.get("id") if isinstance(item.get("id"), str) else f"{_PREFIX[kind]}_{response_id[5:]}_{i}"
        items.append(clean)
    return items


_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _content(content: Any, i: int) -> list[dict[str, Any]]:
    """A message's content as parts: a string is one ``input_text``; text parts are kept, others refused."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return [{"type": p["type"], "text": p["text"]} for p in content]
    raise InvalidInput(f"'input[{i}].content' must be a string or a list of input_text parts (images and files "
                       "are not supported)")


def _text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for p in parts)


def messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages of a conversation's items: consecutive function calls are one assistant message's
    ``tool_calls`` (on the assistant message just before them, if any), each output a ``tool`` message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item["type"] == "message":
            out.append({"role": item["role"], "content": _text_of(item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


# -- the chat body ------------------------------------------------------------------------------------------
def chat_body(body: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body a Responses body means, over the conversation's ``items``."""
    instructions = body.get("instructions")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages(items, instructions)}
    for ours in ("max_output_tokens", "temperature", "top_p", "timeout_ms", "priority", "service_tier", "seed",
                 "prompt_cache_key"):
        theirs = CHAT_NAMES.get(ours, ours)
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None and body.get("tools"):
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    text = body.get("text")
    if text is not None:
        if set(text) - {"format", "verbosity"}:
            raise InvalidInput("'text' takes 'format' (and 'verbosity')")
        fmt = text.get("format")
        if fmt is not None:
            chat["response_format"] = _response_format(fmt)
    return chat


def in_our_terms(error: InvalidInput) -> InvalidInput:
    """A refusal of the chat body :func:`chat_body` made, naming the Responses body's fields (a caller who sent
    ``max_output_tokens`` is told of it, not of ``max_completion_tokens``)."""
    message = error.message
    for ours, theirs in CHAT_NAMES.items():
        message = message.replace(f"'{theirs}'", f"'{ours}'")
    if message == error.message:
        return error
    renamed = type(error)(message, retry_after_s=error.retry_after_s)
    renamed.__cause__ = error
    return renamed


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise InvalidInput(f"'tools[{i}]' must be a function tool {{\"type\": \"function\", \"name\", "
                           "\"parameters\"}} (hosted tools are not supported)")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidInput("'text.format.type' must be text, json_object or json_schema")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise InvalidInput("'text.format' of type json_schema needs a string 'name' and an object 'schema'")
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def may_call(body: dict[str, Any]) -> bool:
    """Whether the answer may hold function calls (``tool_choice: "none"`` shows the model no tools)."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


# -- the Response object ------------------------------------------------------------------------------------
def output_items(response_id: str, text: str, tools: bool) -> list[dict[str, Any]]:
    """The output items of a finished answer's text: its message (if it has text), then its function calls, whose
    arguments are the JSON text as the model wrote it (what a stream sent of them is a prefix of it)."""
    if not tools:
        return [message_item(response_id, text, "completed")]
    whole = tool_stream.view(text, final=True)
    content = whole.content.rstrip() if whole.calls else whole.content
    items = [message_item(response_id, content, "completed")] if content or not whole.calls else []
    items += [function_call_item(response_id, i, call.name, call.arguments, "completed")
              for i, call in enumerate(whole.calls)]
    return items


def message_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{response_id[5:]}", "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(response_id: str, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{response_id[5:]}_{index}", "call_id": call_id(response_id, 0, index),
            "name": name, "arguments": arguments, "status": status}


def usage(result: ItemResult | None) -> dict[str, Any]:
    output = result.output if result is not None else {}
    prompt, completion = int(output.get("prompt_tokens", 0)), int(output.get("completion_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(output.get("cached_tokens", 0))},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(response_id: str, body: dict[str, Any], created_at: float, status: str,
                    result: ItemResult | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's Response object: ``status`` queued/in_progress (no result yet), or the finished ``result``'s
    output (``incomplete`` when max_output_tokens cut it), or ``failed`` with ``error`` {code, message}."""
    out: list[dict[str, Any]] = []
    incomplete = None
    if result is not None:
        out = output_items(response_id, result.output["text"], may_call(body))
        if result.output.get("finish_reason") == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"id": response_id, "object": "response", "created_at": int(created_at), "status": status,
            "background": bool(body.get("background")), "error": error, "incomplete_details": incomplete,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": body.get("model"), "output": out, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": body.get("store", True), "temperature": body.get("temperature", 1.0), "text": {"format": fmt},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "user": body.get("user"),
            "metadata": body.get("metadata") or {}, "usage": usage(result) if result is not None else None}


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
