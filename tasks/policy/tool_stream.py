"""A streamed answer's tool calls, as OpenAI streams them, from the text the model writes so far (pure).

The model writes its calls in the text form of :mod:`tasks.policy.tool_calls`; a client of a stream expects
OpenAI's deltas instead: ``content`` for text outside the calls, and for each call a first ``tool_calls`` entry
with its ``index``, ``id``, ``type`` and ``function.name``, then fragments of its ``function.arguments``.

:func:`view` reads a prefix of the text: the content and calls a client may already be sent, holding back what
a longer prefix could still change (a tail that may begin ``<tool_call>``, trailing whitespace, a call's name
until it is whole, the closing braces of its arguments). Each view extends the one of any shorter prefix, so
:func:`delta` of two views is what goes out between them, and what a client holds at a stream position is the
view of the text up to it: a stream resumed there continues where it stopped. (That holds of every text a
grammar from :mod:`tasks.policy.output_grammar` allows, cut anywhere: a call cut by ``max_tokens`` stays a call
with the arguments written so far, as OpenAI's does. A block that begins as a call and closes as no JSON, which
only unconstrained text can hold, turns into content at its close.)
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.policy.tool_calls import CLOSE, OPEN, call_object

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_HELD = "} \n\t\r"  # may yet close the call's object, not its arguments


@dataclass(frozen=True)
class CallView:
    name: str
    arguments: str  # as much of the arguments' JSON text as is sure


@dataclass(frozen=True)
class View:
    content: str
    calls: tuple[CallView, ...] = ()


def view(text: str, final: bool = False) -> View:
    """What of ``text`` a client may be sent; ``final``: the whole text (nothing held back)."""
    kept: list[str] = []
    calls: list[CallView] = []
    at = 0
    while True:
        start = text.find(OPEN, at)
        if start < 0:
            tail = text[at:]
            kept.append(tail if final else tail[:len(tail) - _begun(tail, OPEN)])
            break
        kept.append(text[at:start])
        end = text.find(CLOSE, start)
        if end < 0:  # open at the end: a call begun (cut by max_tokens if final), or text
            partial = _partial(text[start + len(OPEN):], final)
            if partial is not None:
                calls.append(partial)
            elif final:
                kept.append(text[start:])
            break
        call = _whole(text[start + len(OPEN):end])
        if call is None:
            kept.append(text[start:end + len(CLOSE)])
        else:
            calls.append(call)
        at = end + len(CLOSE)
    content = "".join(kept)
    return View(content if final and not calls else content.rstrip(), tuple(calls))


def _begun(tail: str, tag: str) -> int:
    """How many characters at the end of ``tail`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(tail)), 0, -1):
        if tag.startswith(tail[-size:]):
            return size
    return 0


def _partial(body: str, final: bool) -> CallView | None:
    head = _HEAD.match(body)
    if head is None:
        return None
    rest = body[head.end():]
    if final:  # all there is of its arguments
        return CallView(json.loads(head.group(1)), rest.rstrip())
    return CallView(json.loads(head.group(1)), rest[:len(rest) - _begun(rest, CLOSE)].rstrip(_HELD))


def _whole(body: str) -> CallView | None:
    value = call_object(body)
    if value is None:
        return None
    head, arguments = _HEAD.match(body), value.get("arguments", {})
    if head is not None:  # the arguments as written, so that they extend what was streamed of them
        raw = body[head.end():].rstrip()
        return CallView(value["name"], raw[:-1].rstrip())
    return CallView(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def delta(old: View, new: View, call_id: Callable[[int], str]) -> dict[str, Any]:
    """The chat delta that takes a client from ``old`` to ``new`` (``{}``: nothing new); ``call_id(index)``
    names a call (:func:`tasks.policy.tool_calls.call_id`)."""
    out: dict[str, Any] = {}
    if len(new.content) > len(old.content):
        out["content"] = new.content[len(old.content):]
    entries: list[dict[str, Any]] = []
    for i, call in enumerate(new.calls):
        if i >= len(old.calls):
            entries.append({"index": i, "id": call_id(i), "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
        elif len(call.arguments) > len(old.calls[i].arguments):
            entries.append({"index": i, "function": {"arguments": call.arguments[len(old.calls[i].arguments):]}})
    if entries:
        out["tool_calls"] = entries
    return out


def finish_reason(called: bool, reason: str) -> str:
    """OpenAI's: ``tool_calls`` when the model stopped after calling tools; ``length`` (cut) stays."""
    return "tool_calls" if called and reason == "stop" else reason
