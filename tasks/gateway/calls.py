"""What goes through the gateway and what comes back: a validated call, its answer, a call as looked up by id,
and a streamed call's events. Values only: the web app builds and renders them without touching Redis."""
from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass

from tasks.errors import BatchingError
from tasks.policy.stream_position import Position
from tasks.schema import NO_PARAMS, ItemResult, Priority, SamplingParams
from tasks.state.records import Record, State


@dataclass(frozen=True)
class Call:
    """One validated API call."""

    request_id: str
    tenant: str
    model: str
    inputs: tuple[str, ...]
    timeout_ms: int
    params: SamplingParams = NO_PARAMS  # model parameters, passed to the worker as they are
    weight: float = 1.0  # the tenant's share of batch slots when tenants compete
    priority: Priority = Priority.INTERACTIVE
    tenant_cap: int | None = None  # the tenant's in-flight cap (None: only the global caps)
    received_at: float | None = None  # when it reached this host (monotonic): its deadline counts from then
    trace: str | None = None  # W3C traceparent: the caller's, then (in the gateway) its own llmb.call span's


@dataclass(frozen=True)
class Answer:
    """Every item's result, in input order, with when the call was accepted."""

    results: tuple[ItemResult, ...]
    accepted_at: float
    request_id: str = ""  # the call that ran: this one, or the first one for an idempotent retry (``replayed``)
    total_ms: float | None = None  # arrival to answer, as the server saw it
    replayed: bool = False


@dataclass(frozen=True)
class Lookup:
    """A call as ``GET /v1/requests/<id>`` shows it: running, or finished with its answer or its error."""

    record: Record
    state: State
    present: int  # items with a result
    answer: Answer | None = None
    error: BatchingError | None = None


@dataclass(frozen=True)
class Delta:
    """Streamed text of one item of a call (``index``: its position in the call's inputs; ``offset``: where the
    text starts in the item's whole text, -1 if unknown)."""

    index: int
    text: str
    offset: int = -1


@dataclass(frozen=True)
class Done:
    """One item of a streamed call finished: its whole result (the text streamed so far is a prefix of it)."""

    index: int
    result: ItemResult


Event = Delta | Done | BatchingError  # a streamed call's events; an error ends the stream


class Events:
    """A streamed call's events (see :meth:`tasks.gateway.gateway.Gateway.stream`): iterate them; closing early
    cancels the generation. ``request_id`` is the call's (the first call's, for a replayed idempotent retry)."""

    def __init__(self, request_id: str, events: Generator[Event, None, None], replayed: bool = False) -> None:
        self.request_id = request_id
        self.replayed = replayed
        self._events = events

    def __iter__(self) -> Iterator[Event]:
        return self._events

    def close(self) -> None:
        self._events.close()


@dataclass(frozen=True)
class Resumed:
    """A streamed call resumed (:meth:`tasks.gateway.gateway.Gateway.resume`): its record, the client's position,
    and the events after it."""

    record: Record
    position: Position
    events: Iterator[Event]
