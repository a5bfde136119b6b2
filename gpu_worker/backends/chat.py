"""Chat messages as the web layer passes them (OpenAI's shape), made ready for a chat template, and the plain
transcript of a model without one. Torch-free: sim-lm and hf-causal share it.

Agents send back what the model said and what the tools answered: an assistant message may carry ``tool_calls``
(OpenAI's shape, ``function.arguments`` as JSON text) and a null content, and a ``tool`` message carries
``tool_call_id`` and the tool's output. A transcript writes an assistant's calls in the text form the model
answers in (:func:`tasks.policy.tool_calls.render`), so the conversation reads as the model wrote it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tasks.policy.tool_calls import ToolCall, render


def content(message: Mapping[str, Any]) -> str:
    """A message's text: its content (text parts joined), then its tool calls as the model writes them."""
    body = message.get("content")
    if isinstance(body, list):
        body = "".join(str(part.get("text", "")) for part in body if isinstance(part, Mapping))
    text = "" if body is None else str(body)
    calls = [render(call) for call in tool_calls(message)]
    return "\n".join([text, *calls]) if text and calls else text + "\n".join(calls)


def tool_calls(message: Mapping[str, Any]) -> list[ToolCall]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        calls.append(ToolCall(str(function.get("name", "")),
                              arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return calls


def transcript(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], line: str,
               end: str) -> str:
    """A plain transcript: each message as ``line`` (a format of ``role`` and ``content``), then ``end``; the tools,
    when there are any, first, as a ``tools`` line of their JSON."""
    head = line.format(role="tools", content=json.dumps(list(tools))) if tools else ""
    return head + "".join(line.format(role=m["role"], content=content(m)) for m in messages) + end


def answers_tool(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the conversation's last word is a tool's (the model is to answer its result)."""
    return bool(messages) and messages[-1].get("role") == "tool"


def for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates read them: a null content as empty text, and a tool call's arguments
    as an object (templates write them with ``tojson``)."""
    out = []
    for m in messages:
        message = dict(m)
        if message.get("content") is None:
            message["content"] = ""
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {"name": c.name, "arguments": _object(c.arguments)}}
                for call, c in zip(message["tool_calls"], tool_calls(m))]
        out.append(message)
    return out


def _object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
