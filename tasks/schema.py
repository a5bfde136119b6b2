"""Messages that cross process boundaries, as frozen dataclasses decoded at the edge.

Wire format is JSON. Deadlines and timestamps are wall-clock epoch seconds because they travel between
machines (hosts are assumed NTP-synchronised); each process converts them to its own monotonic clock
before any policy sees them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any


def json_integer(value: object) -> int | None:
    """``value`` as an integer when JSON says it is one: an int, or a float with no fraction (``5.0``, as JSON
    Schema and OpenAI's own validation count it); None for anything else (booleans included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


class Priority(StrEnum):
    """A call's class: interactive items go first in every batch; offline ones fill what is left and may wait."""

    INTERACTIVE = "interactive"
    OFFLINE = "offline"


def input_hash(model: str, text: str) -> str:
    """Identity of an input for quarantine: the same text sent to the same model."""
    return hashlib.sha256(f"{model}\0{text}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Item:
    """One input to run; ``id`` is server-generated and unique, so outputs can never cross callers."""

    id: str
    input: str


@dataclass(frozen=True)
class InferenceRequest:
    """One HTTP call as published to the request queue; it carries one or more items."""

    id: str  # correlation id (X-Request-Id)
    tenant: str
    model: str
    items: tuple[Item, ...]
    accepted_at: float
    deadline: float
    reply_to: str  # Redis channel of the API process holding the connection
    params: dict[str, Any] = field(default_factory=dict)  # model parameters (max_tokens, temperature, ...)
    weight: float = 1.0  # the tenant's share when tenants compete for batch slots
    priority: Priority = Priority.INTERACTIVE
    trace: str | None = None  # the W3C traceparent of its call's span (tracing on: tasks.tracing)

    def to_dict(self) -> dict[str, Any]:
        # by hand rather than dataclasses.asdict, whose deep copies cost more than the rest of the encoding
        out = {**vars(self), "items": [{**vars(i)} for i in self.items], "params": {**self.params}}
        if self.trace is None:  # as versions before tracing wrote it: they read it during a rolling upgrade
            del out["trace"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InferenceRequest:
        """Decode a request message; raises ValueError on anything malformed."""
        try:
            items = tuple(Item(id=str(i["id"]), input=str(i["input"])) for i in d["items"])
            if not items:
                raise ValueError("request has no items")
            return cls(
                id=str(d["id"]), tenant=str(d["tenant"]), model=str(d["model"]), items=items,
                accepted_at=float(d["accepted_at"]), deadline=float(d["deadline"]), reply_to=str(d["reply_to"]),
                params=dict(d.get("params") or {}), weight=float(d.get("weight", 1.0)),
                priority=Priority(d.get("priority", Priority.INTERACTIVE)),
                trace=d.get("trace") if isinstance(d.get("trace"), str) else None,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed request message: {exc!r}") from None


@dataclass(frozen=True)
class BatchItem:
    """An item as a worker sees it: enough to run it, answer it, and drop it if its caller is gone."""

    id: str
    request_id: str
    input: str
    deadline: float
    accepted_at: float
    reply_to: str
    tenant: str = "default"
    retries: int = 0  # times re-dispatched because its worker was lost before running it
    params: dict[str, Any] = field(default_factory=dict)
    died_on: tuple[str, ...] = ()  # workers that died (or vanished) while running a batch holding this item
    priority: Priority = Priority.INTERACTIVE  # its call's class, kept so the ledger (and a replay) knows it
    trace: str | None = None  # its call's traceparent (tracing on)


class Failure(StrEnum):
    """Why a batch came back to the batcher instead of finishing."""

    RAISED = "raised"  # the model raised on it
    DIED = "died"  # its worker died (or went silent) while running it
    STRANDED = "stranded"  # its worker was lost before it started
    RETURNED = "returned"  # its worker was stopping and handed it back unstarted (no retry is charged)


@dataclass(frozen=True)
class Batch:
    """What the batcher hands to one GPU worker: one Celery task."""

    id: str
    model: str
    items: tuple[BatchItem, ...]
    created_at: float
    parent_id: str | None = None  # the failed batch this one was split from or re-dispatched for
    attempt: int = 0  # failures in its ancestry: 0 for a batch of fresh requests
    trace: str | None = None  # the traceparent of its llmb.batch span (tracing on, a member sampled)

    def to_dict(self) -> dict[str, Any]:
        # by hand, as InferenceRequest's; without tracing, as versions before it wrote it (a rolling upgrade)
        out = {**vars(self), "items": [_item_dict(i) for i in self.items]}
        if self.trace is None:
            del out["trace"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Batch:
        return cls(
            id=str(d["id"]), model=str(d["model"]), created_at=float(d["created_at"]),
            items=tuple(BatchItem(**{**i, "died_on": tuple(i.get("died_on") or ()),
                                     "priority": Priority(i.get("priority", Priority.INTERACTIVE))})
                        for i in d["items"]),
            parent_id=d.get("parent_id"), attempt=int(d.get("attempt", 0)), trace=d.get("trace"),
        )

    def with_items(self, items: tuple[BatchItem, ...]) -> Batch:
        return replace(self, items=items)

    def derive(self, new_id: str, items: tuple[BatchItem, ...], *, now: float) -> Batch:
        """A new batch carrying some of this one's items (a half after a failure, or all of them again)."""
        return replace(self, id=new_id, items=items, created_at=now, parent_id=self.id, attempt=self.attempt + 1)


def _item_dict(item: BatchItem) -> dict[str, Any]:
    out = {**vars(item), "params": {**item.params}}
    if item.trace is None:
        del out["trace"]
    return out


@dataclass(frozen=True)
class ItemResult:
    """What a worker writes to an item's result key: an output or an error, plus where and when it ran."""

    output: Any = None
    error: str | None = None  # error type, e.g. "inference_failed"
    message: str | None = None
    batch_id: str = ""
    batch_size: int = 0
    worker: str = ""
    started_at: float = 0.0
    run_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}  # no deep copy of the output: it is encoded

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ItemResult:
        return cls(**d)


DRAINING = "draining"


@dataclass(frozen=True)
class WorkerInfo:
    id: str  # Celery hostname, e.g. gpu0@host
    queue: str  # the worker's own batch queue
    model: str
    max_batch: int
    state: str  # "idle", "busy" or DRAINING (stopping: finishing its batch, taking no more)
    outstanding: int  # batches received and not finished, the running one included
    completed: int  # batches finished since the worker started
    batch_started_at: float | None  # when the running batch started, if busy
    batch_ms_estimate: float  # moving average of batch run time
    heartbeat_at: float
    free_in_ms: float = 0.0  # estimated time until the running batch ends
    kind: str = "sim"  # "sim", "causal" or "embed"
    slots: int = 1  # batches it runs at once (continuous batching: several share the decode batch)
    kv_tokens: int = 0  # continuous batching: tokens its KV cache holds, the real limit on concurrency
    kv_used: int = 0  # of those, tokens held by running sequences now
    tokens_per_s: float = 0.0  # over the last minute
    utilisation: float = 0.0  # fraction of the last minute spent running batches
    max_context: int = 0  # tokens per item (prompt + output), 0 when it does not apply
    # its prefix cache (generating backends that keep one; 0 elsewhere): whether it keeps one, whole prompt pages
    # looked up on admission since it started, those found cached (not prefilled again), and the prompt pages it
    # holds or caches now
    prefix_caching: bool = False
    prefix_queries: int = 0
    prefix_hits: int = 0
    cached_blocks: int = 0
    prefixes: tuple[str, ...] = ()  # the prefix keys it holds (tasks.policy.prefixes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        """A heartbeat; fields a newer worker added are left out, so a batcher reads it during a rolling upgrade."""
        known = {f.name for f in fields(cls)}
        info = cls(**{k: v for k, v in json.loads(raw).items() if k in known})
        return replace(info, prefixes=tuple(info.prefixes)) if info.prefixes else info


@dataclass(frozen=True)
class BatchEvent:
    """A worker started or finished a batch: the scheduler's view of each device, as it happens."""

    worker: str
    batch_id: str
    event: str  # "started" or "finished"
    run_ms: float | None = None
    tokens: dict[str, int] | None = None  # finished: prompt + completion tokens its items took, by tenant
    at: float | None = None  # when it happened, epoch seconds on the worker's clock (None from older workers)
    idle_ms: float | None = None  # started: how long the device had been free when this batch reached the worker

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> BatchEvent:
        event = str(d["event"])
        if event not in ("started", "finished"):
            raise ValueError(f"unknown batch event {event!r}")
        run_ms, tokens, at, idle_ms = d.get("run_ms"), d.get("tokens"), d.get("at"), d.get("idle_ms")
        return cls(worker=str(d["worker"]), batch_id=str(d["batch_id"]), event=event,
                   run_ms=None if run_ms is None else float(run_ms),  # type: ignore[arg-type]
                   tokens={str(k): int(v) for k, v in tokens.items()} if isinstance(tokens, dict) else None,
                   at=float(at) if isinstance(at, (int, float)) else None,
                   idle_ms=float(idle_ms) if isinstance(idle_ms, (int, float)) else None)
