"""A streamed call's events as server-sent events in OpenAI's chunk format, each with its SSE ``id``.

One renderer for the stream a call starts (:mod:`webapp.openai_api`) and for a stream resumed from a client's
``Last-Event-ID`` (:mod:`webapp.requests_api`): the id of each event is the client's position after it
(:mod:`tasks.policy.stream_position`), and what was already sent at the starting position is not sent again,
so a resumed stream continues the first one event for event.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from flask import Response, stream_with_context

from tasks.errors import BatchingError
from tasks.gateway.calls import Delta, Done, Event
from tasks.policy.stream_position import Position, text_after
from tasks.schema import ItemResult
from webapp.errors import OPENAI
from webapp.openai_schema import Named, Streaming, chunk, usage_chunk
from webapp.openai_tools import StreamedCalls


def render(call: Named, chat: bool, streaming: Streaming, openings: Sequence[Any], choices: int,
           events: Iterable[Event], position: Position,
           on_error: Callable[[BatchingError], None] = lambda error: None, tools: bool = False) -> Iterator[str]:
    """The events after ``position``: each unopened choice's opening (``openings[i]``: its role delta or the
    prompt it echoes; None: it has none), then a chunk per Delta and a last chunk per Done (the rest of its
    text, its finish_reason and log-probabilities), the usage chunk if asked for, and ``[DONE]``. An error ends
    the stream with an error event (no id: it is not a position). ``choices``: each prompt's ``n``. ``tools``:
    a chat call whose answers may hold tool calls, streamed as OpenAI streams them
    (:class:`webapp.openai_tools.StreamedCalls`)."""
    done: dict[int, ItemResult] = {}
    shaper = StreamedCalls(call.request_id, [c.sent for c in position.choices]) if tools else _Text()
    gap: set[int] = set()  # choices a piece of whose text was lost: the rest of it comes with their last chunk
    for index, opening in enumerate(openings):
        if not position.choices[index].opened:
            position = position.opened(index)
            if opening is not None:
                yield _event(chunk(call, chat, opening, None, streaming, index), position)
    for event in events:
        if isinstance(event, Delta):
            position, piece = _piece(event, position, gap, shaper)
            if piece:
                yield _event(chunk(call, chat, piece, None, streaming, event.index), position)
        elif isinstance(event, Done):
            done[event.index] = event.result
            had = position.choices[event.index]
            if had.finished:
                continue
            output = event.result.output
            position = position.finished(event.index, len(output["text"]))
            last, reason = shaper.last(event.index, had.sent, output)
            yield _event(chunk(call, chat, last, reason, streaming, event.index, output), position)
        else:
            on_error(event)
            yield f"data: {json.dumps(OPENAI.of(event, call.request_id))}\n\n"
    if streaming.include_usage and not position.usage_sent and len(done) == len(openings):
        position = position.with_usage()
        yield _event(usage_chunk(call, chat, tuple(done[i] for i in sorted(done)), choices, streaming), position)
    yield "data: [DONE]\n\n"


class _Text:
    """A choice's text as it comes (a call whose answers hold no tool calls)."""

    def delta(self, index: int, sent: int, text: str) -> str:
        return text

    def last(self, index: int, sent: int, output: dict[str, Any]) -> tuple[str, str]:
        return output["text"][sent:], output["finish_reason"]


def _piece(event: Delta, position: Position, gap: set[int], shaper: StreamedCalls | _Text) -> tuple[Position, Any]:
    """The position after a Delta, and what goes out of it (empty or None: nothing now). A piece held back whole
    (a resumed choice's tool calls) leaves the position where it was: the rest comes with the choice's end."""
    had = position.choices[event.index]
    if had.finished or event.index in gap:
        return position, None
    if event.offset > had.sent:  # a piece before this one never came (a lost message)
        gap.add(event.index)
        return position, None
    # a batch run again (its worker lost, or split) streams its text again from the start: only what the client
    # lacks goes out
    text = event.text if event.offset < 0 else text_after(had.sent, event.offset, event.text)
    if not text:
        return position, None
    piece = shaper.delta(event.index, had.sent, text)
    return (position, None) if piece is None else (position.advanced(event.index, len(text)), piece)


def response(body: Iterator[str]) -> Response:
    """The streamed response of rendered events, in the request's context until its last byte."""
    return Response(stream_with_context(body), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(payload: dict[str, Any], position: Position) -> str:
    return f"id: {position}\ndata: {json.dumps(payload)}\n\n"
