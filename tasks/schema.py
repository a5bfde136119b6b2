"""Messages that cross process boundaries, as frozen dataclasses decoded at the edge.

Wire format is JSON. Deadlines and timestamps are wall-clock epoch seconds because they travel between
machines (hosts are assumed NTP-synchronised); each process converts them to its own monotonic clock
before any policy sees them.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.manual_seed takes
MAX_CHOICES = 16  # most choices (n) one call may ask for

# The format of the messages between processes (a request the web app publishes, a batch a batcher sends, an
# item's result): its ``v``. A message without one is format 1 (the versions before this field). Readers accept
# the previous format and the next one, so that during a rolling upgrade (or its rollback) old and new processes
# read each other: fields they do not know are ignored, fields a message lacks take their defaults.
FORMAT_VERSION = 2
FORMATS_READ = range(1, FORMAT_VERSION + 2)  # 1 to the next format


def format_of(d: dict[str, Any]) -> int:
    """The format version of a decoded message; ValueError for one this version cannot read."""
    v = d.get("v", 1)
    if isinstance(v, bool) or not isinstance(v, int) or v not in FORMATS_READ:
        raise ValueError(f"message format {v!r} is not one this version reads ({FORMATS_READ.start} to "
                         f"{FORMATS_READ.stop - 1})")
    return v


def known_fields(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """``d`` less the keys ``cls`` (a dataclass) has no field for: a newer version's additions, and ``v``."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in fields(cls))
    return {k: v for k, v in d.items() if k in names}


_FIELD_NAMES: dict[type, frozenset[str]] = {}


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


def _range(low: float, high: float) -> dict[str, float]:
    """A field's accepted values, read by the parser (webapp.openai_schema) and the API document (webapp.openapi)."""
    return {"minimum": low, "maximum": high}


@dataclass(frozen=True)
class SamplingParams:
    """What a call asks of the model, validated once where its request was parsed (:mod:`webapp.openai_schema`)
    and read by attribute from there to the backend. A call that generates nothing (embeddings, /v1/infer) has
    no ``max_tokens``.

    Its wire form (:meth:`to_dict`) is the JSON object of the versions before this class: the same keys, each
    present when it was then, so processes of either version read each other's messages during a rolling
    upgrade; keys a newer version added are kept in ``unknown`` and passed on as they came."""

    max_tokens: int | None = None  # output tokens it may generate (None: not a generation call)
    temperature: float = field(default=1.0, metadata=_range(0, 2))  # 0: greedy
    top_p: float = field(default=1.0, metadata=_range(0, 1))
    stop: tuple[str, ...] = ()  # the text is cut at the first of these
    seed: int | None = field(default=None, metadata=_range(SEED_MIN, SEED_MAX))  # None: fresh randomness
    logprobs: int | None = None  # how many likeliest tokens to give at each position (None: no logprobs)
    echo: bool = False  # the prompt's tokens and their logprobs too (scoring a given text, max_tokens 0)
    n: int = field(default=1, metadata=_range(1, MAX_CHOICES))  # choices of each prompt (items of the call)
    chat: bool = False  # the input is a JSON list of messages, for the model's chat template
    stream: bool = False  # its text is streamed as it comes
    # what constrains and shapes the answer (issue 42): a grammar in llguidance's Lark syntax, built by the web
    # layer from response_format or tools (tasks.policy.tool_calls for the tool-call text format); the tools, for
    # the model's chat template; penalties and biases applied to each step's logits, as OpenAI defines them
    grammar: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    presence_penalty: float = field(default=0.0, metadata=_range(-2, 2))
    frequency_penalty: float = field(default=0.0, metadata=_range(-2, 2))
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias from -100 to 100)
    prompt_cache_key: str | None = None  # a routing hint: the same key's prompt starts go to the same worker
    # a LoRA adapter of the call's model (issue 44): its name as the caller named it in ``model`` (the call's model
    # is then the adapter's base), and its PEFT directory (adapter_config.json + weights) as the workers see it;
    # None: the base model alone
    adapter: str | None = None
    adapter_path: str | None = None
    adapter_pinned: bool = False  # an operator pinned it: once loaded, a worker never evicts it
    unknown: dict[str, Any] = field(default_factory=dict, repr=False)  # keys of a newer version, kept as they came

    def to_dict(self) -> dict[str, Any]:
        """The wire form: a generation call's first five fields always (every version wrote them), every other
        field only when it is not its default."""
        if self is NO_PARAMS:  # a call that generates nothing (the common case of /v1/infer): nothing to look at
            return {}
        generation = self.max_tokens is not None
        out: dict[str, Any] = {}
        for name, default in _WIRE:
            value = getattr(self, name)
            if value != default or (generation and name in _ALWAYS):
                out[name] = list(value) if isinstance(value, tuple) else value
        return {**out, **self.unknown} if self.unknown else out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Decode the wire form (a null or missing value: the field's default); raises ValueError or TypeError on
        a value of the wrong type."""
        if not isinstance(d, dict):
            raise TypeError(f"params must be an object, not {type(d).__name__}")
        if not d:
            return NO_PARAMS
        known: dict[str, Any] = {}
        unknown: dict[str, Any] = {}
        for key, value in d.items():
            decode = _DECODERS.get(key)
            if decode is None:
                unknown[key] = value
            elif value is not None:
                known[key] = decode(value)
        return cls(**known, unknown=unknown) if unknown else cls(**known)


NO_PARAMS = SamplingParams()
_ALWAYS = frozenset({"max_tokens", "temperature", "top_p", "stop", "seed"})  # in every generation call's params
_WIRE = tuple((f.name, getattr(NO_PARAMS, f.name)) for f in fields(SamplingParams) if f.name != "unknown")
# a field's wire value decoded by its type, so that a new field of one of these types needs no code here
_BY_TYPE: dict[str, Callable[[Any], Any]] = {
    "int | None": int, "int": int, "float": float, "bool": bool,
    "tuple[str, ...]": lambda v: (v,) if isinstance(v, str) else tuple(str(s) for s in v),
    "str | None": str,
    "tuple[dict[str, Any], ...]": lambda v: tuple(dict(t) for t in v),
    "tuple[tuple[int, float], ...]": lambda v: tuple((int(t), float(b)) for t, b in v)}
_DECODERS = {f.name: _BY_TYPE[str(f.type)] for f in fields(SamplingParams) if f.name != "unknown"}


def bounds(name: str) -> dict[str, float]:
    """The accepted range of a field of :class:`SamplingParams` (``minimum``, ``maximum``)."""
    return dict(next(f.metadata for f in fields(SamplingParams) if f.name == name))


# one token's log-probability: its text, its logprob (None for a text's first token, which nothing predicts) and
# the likeliest tokens at its position as [text, logprob] pairs, likeliest first
Entry = dict[str, Any]


@dataclass(frozen=True)
class GenerationOutput:
    """What a generating backend returns for one item; its worker writes :meth:`to_dict` to the item's result."""

    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[Entry] | None = None  # one per completion token, when asked for
    prompt: str | None = None  # with echo: the prompt as the model read it
    prompt_logprobs: list[Entry] | None = None  # with echo: one per prompt token
    token_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)  # kept to score; not sent
    cached_tokens: int = 0  # of the prompt's tokens, those the prefix cache held (usage's cached_tokens)

    @property
    def tokens(self) -> int:
        """What the item took of the device: its prompt and completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text, "finish_reason": self.finish_reason,
                               "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.prompt is not None:
            out["prompt"], out["prompt_logprobs"] = self.prompt, self.prompt_logprobs or []
        if self.cached_tokens:
            out["cached_tokens"] = self.cached_tokens
        return out


@dataclass(frozen=True)
class EmbeddingOutput:
    """What an embedding backend returns for one item."""

    embedding: list[float]
    prompt_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"embedding": self.embedding, "prompt_tokens": self.prompt_tokens}


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
    params: SamplingParams = NO_PARAMS
    weight: float = 1.0  # the tenant's share when tenants compete for batch slots
    priority: Priority = Priority.INTERACTIVE
    trace: str | None = None  # the W3C traceparent of its call's span (tracing on: tasks.tracing)

    def to_dict(self) -> dict[str, Any]:
        # by hand rather than dataclasses.asdict, whose deep copies cost more than the rest of the encoding
        out = {"v": FORMAT_VERSION, **vars(self), "items": [{**vars(i)} for i in self.items],
               "params": self.params.to_dict()}
        if self.trace is None:  # as versions before tracing wrote it: they read it during a rolling upgrade
            del out["trace"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InferenceRequest:
        """Decode a request message (formats :data:`FORMATS_READ`; unknown keys ignored); raises ValueError on
        anything malformed."""
        try:
            format_of(d)
            items = tuple(Item(id=str(i["id"]), input=str(i["input"])) for i in d["items"])
            if not items:
                raise ValueError("request has no items")
            return cls(
                id=str(d["id"]), tenant=str(d["tenant"]), model=str(d["model"]), items=items,
                accepted_at=float(d["accepted_at"]), deadline=float(d["deadline"]), reply_to=str(d["reply_to"]),
                params=SamplingParams.from_dict(d.get("params") or {}), weight=float(d.get("weight", 1.0)),
                priority=Priority(d.get("priority", Priority.INTERACTIVE)),
                trace=d.get("trace") if isinstance(d.get("trace"), str) else None,
            )
        except (KeyError, TypeError, AttributeError) as exc:
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
    params: SamplingParams = NO_PARAMS
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
        out = {"v": FORMAT_VERSION, **vars(self), "items": [_item_dict(i) for i in self.items]}
        if self.trace is None:
            del out["trace"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Batch:
        """Decode a batch (formats :data:`FORMATS_READ`: keys of a newer version ignored, in the batch and in its
        items); ValueError for a format it cannot read, KeyError or TypeError for a malformed one."""
        format_of(d)
        return cls(
            id=str(d["id"]), model=str(d["model"]), created_at=float(d["created_at"]),
            items=tuple(BatchItem(**{**known_fields(BatchItem, i), "died_on": tuple(i.get("died_on") or ()),
                                     "params": SamplingParams.from_dict(i.get("params") or {}),
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
    out = {**vars(item), "params": item.params.to_dict()}
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
        """The result record. Without ``v`` in this format (2): format 1's readers took every key as a field and
        would fail on it, so it is written from format 3 on, once every reader is of this version or later."""
        return {k: v for k, v in vars(self).items() if v is not None}  # no deep copy of the output: it is encoded

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ItemResult:
        """Decode a result record (formats :data:`FORMATS_READ`; keys of a newer version ignored)."""
        format_of(d)
        return cls(**known_fields(cls, d))


DRAINING = "draining"
STARTING = "starting"  # beating, but its consumer is not consuming yet: no batch is sent to it
NOT_TAKING_WORK = frozenset({DRAINING, STARTING})


@dataclass(frozen=True)
class WorkerInfo:
    id: str  # Celery hostname, e.g. gpu0@host
    queue: str  # the worker's own batch queue
    model: str
    max_batch: int
    state: str  # "idle", "busy", STARTING (not consuming yet) or DRAINING (finishing its batch, taking no more)
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
    # LoRA adapters (issue 44; tasks.policy.adapter_residency): how many it may hold (0: it serves none), those
    # resident now (most recently used first) and those loading, and its loads and evictions since it started
    max_adapters: int = 0
    adapters: tuple[str, ...] = ()
    adapters_loading: tuple[str, ...] = ()
    adapter_loads: int = 0
    adapter_evictions: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        """A heartbeat; fields a newer worker added are left out, so a batcher reads it during a rolling upgrade."""
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in json.loads(raw).items() if k in known}
        for name in ("prefixes", "adapters", "adapters_loading"):  # JSON lists, kept as tuples
            if name in d:
                d[name] = tuple(d[name])
        return cls(**d)


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
