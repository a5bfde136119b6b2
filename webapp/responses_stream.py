"""A response's stream: the gateway's events of its chat call as the Responses API's server-sent events.

    response.created  response.in_progress  response.output_item.added  response.content_part.added
    response.output_text.delta ...  response.output_text.done  response.content_part.done
    response.output_item.done  [function_call items: output_item.added, function_call_arguments.delta/.done,
    output_item.done]  response.completed | response.incomplete | response.failed

Each event carries a ``sequence_number``, counted from 0. The numbering depends only on the call's events, which
are the same on the first stream and on a stream resumed from the journal (:mod:`tasks.gateway.resume`): a client
that resumes after event N (``GET /v1/responses/{id}?stream=true&starting_after=N``) gets the events after it.
With tools, the text streams as :func:`tasks.policy.tool_stream.view` reads it: a message's text while no call
has begun (what may yet open a call held back), each call's arguments as they are written. Pure: no I/O.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tasks.errors import BatchingError
from tasks.gateway.calls import Delta, Done, Event
from tasks.policy import tool_stream
from tasks.policy.stream_position import text_after
from tasks.policy.tool_calls import ToolCall, render
from tasks.schema import ItemResult
from webapp.responses_schema import function_call_item, may_call, message_item, output_text, response_object


class Numbered:
    """Events numbered in order; only those after ``starting_after`` are yielded."""

    def __init__(self, starting_after: int) -> None:
        self.next = 0
        self.starting_after = starting_after

    def __call__(self, kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
        number, self.next = self.next, self.next + 1
        if number > self.starting_after:
            yield {"type": kind, "sequence_number": number, **fields}


def events(response_id: str, request: dict[str, Any], created_at: float, calls: Iterable[Event],
           starting_after: int = -1, on_end: Callable[[dict[str, Any]], object] = lambda response: None,
           ) -> Iterator[dict[str, Any]]:
    """The response's events after ``starting_after``; ``on_end`` gets its final Response object."""
    emit = Numbered(starting_after)
    running = response_object(response_id, request, created_at, "in_progress")
    yield from emit("response.created", response=running)
    yield from emit("response.in_progress", response=running)
    out = _Output(emit, response_id, may_call(request))
    text, gap = "", False
    for event in calls:
        if isinstance(event, Delta):
            if gap:
                continue
            if event.offset > len(text):  # a piece never came: the rest comes with the end
                gap = True
                continue
            piece = event.text if event.offset < 0 else text_after(len(text), event.offset, event.text)
            if piece:
                text += piece
                yield from out.follow(text)
        elif isinstance(event, Done):
            final = response_object(response_id, request, created_at, "completed", event.result)
            final["output"] = out.ordered(final["output"])
            yield from out.finish(final)
            on_end(final)
            return
        else:
            failed = response_object(response_id, request, created_at, "failed", error=error_of(event))
            yield from emit("error", code=event.type, message=event.message, param=None)
            yield from emit("response.failed", response=failed)
            on_end(failed)
            return


def error_of(error: BatchingError) -> dict[str, Any]:
    return {"code": error.type, "message": error.message}


Key = str | int  # an output item: "message", or a function call's index


class _Output:
    """The output items of a stream as they open, in the order they opened (their ``output_index``), and what
    was sent of each: the message's text, each call's arguments. With tools, what is sent of the text so far is
    :func:`tasks.policy.tool_stream.view`'s (text that may yet become a call is held back); a message's text stops
    streaming once a call has begun (its rest comes at the end)."""

    def __init__(self, emit: Numbered, response_id: str, tools: bool) -> None:
        self.emit, self.id, self.tools = emit, response_id, tools
        self.order: list[Key] = []
        self.text = ""
        self.arguments: dict[int, str] = {}

    def follow(self, text: str) -> Iterator[dict[str, Any]]:
        if not self.tools:
            yield from self._text(text)
            return
        seen = tool_stream.view(text)
        if not seen.calls:
            yield from self._text(seen.content)
        for i, call in enumerate(seen.calls):
            if i not in self.arguments:
                yield from self._open_call(i, call.name)
            yield from self._arguments(i, call.arguments)

    def _text(self, text: str) -> Iterator[dict[str, Any]]:
        if len(text) <= len(self.text) or not text.startswith(self.text):
            return
        if "message" not in self.order:
            yield from self._open_message()
        delta, self.text = text[len(self.text):], text
        yield from self.emit("response.output_text.delta", item_id=f"msg_{self.id[5:]}",
                             output_index=self.order.index("message"), content_index=0, delta=delta, logprobs=[])

    def _open_message(self) -> Iterator[dict[str, Any]]:
        self.order.append("message")
        index, message = len(self.order) - 1, message_item(self.id, "", "in_progress")
        yield from self.emit("response.output_item.added", output_index=index, item=message)
        yield from self.emit("response.content_part.added", item_id=message["id"], output_index=index,
                             content_index=0, part=output_text(""))

    def _open_call(self, i: int, name: str) -> Iterator[dict[str, Any]]:
        self.order.append(i)
        self.arguments[i] = ""
        yield from self.emit("response.output_item.added", output_index=len(self.order) - 1,
                             item=function_call_item(self.id, i, name, "", "in_progress"))

    def _arguments(self, i: int, arguments: str) -> Iterator[dict[str, Any]]:
        sent = self.arguments[i]
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return
        self.arguments[i] = arguments
        yield from self.emit("response.function_call_arguments.delta", item_id=f"fc_{self.id[5:]}_{i}",
                             output_index=self.order.index(i), delta=arguments[len(sent):])

    def ordered(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The final output items in the order the stream opened them (those it did not, after, as they are)."""
        keyed = {_key(item): item for item in output}
        return [keyed[k] for k in self.order if k in keyed] + [item for k, item in keyed.items() if k not in self.order]

    def finish(self, final: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The rest of each item and its closing events, then the response's end."""
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if "message" not in self.order:
                    yield from self._open_message()
                yield from self._text(text)
                yield from self.emit("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text, logprobs=[])
                yield from self.emit("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=output_text(text))
            else:
                i = _key(item)
                assert isinstance(i, int)
                if i not in self.arguments:
                    yield from self._open_call(i, item["name"])
                yield from self._arguments(i, item["arguments"])
                yield from self.emit("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"])
            yield from self.emit("response.output_item.done", output_index=index, item=item)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield from self.emit(kind, response=final)


def _key(item: dict[str, Any]) -> Key:
    return "message" if item["type"] == "message" else int(item["id"].rsplit("_", 1)[1])


def stored_events(final: dict[str, Any], request: dict[str, Any], starting_after: int) -> Iterator[dict[str, Any]]:
    """The events of a finished response whose call's record is gone: as if its text came in one piece."""
    if final["status"] in ("failed", "cancelled"):
        emit = Numbered(starting_after)
        yield from emit("response.created", response=final)
        yield from emit("response.failed" if final["status"] == "failed" else "response.cancelled", response=final)
        return
    text = "".join(_item_text(item) for item in final["output"])
    output = {"text": text, "finish_reason": "length" if final["status"] == "incomplete" else "stop",
              "prompt_tokens": (final.get("usage") or {}).get("input_tokens", 0),
              "completion_tokens": (final.get("usage") or {}).get("output_tokens", 0)}
    result = ItemResult(output=output)
    yield from events(final["id"], request, final["created_at"], [Done(0, result)], starting_after)


def _item_text(item: dict[str, Any]) -> str:
    if item["type"] == "message":
        return "".join(part.get("text", "") for part in item["content"])
    return render(ToolCall(item["name"], item["arguments"]))


def as_sse(event: dict[str, Any]) -> str:
    """One event as OpenAI sends it: its type as the SSE event name, the event as its data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
