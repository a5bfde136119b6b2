"""What a call's record says, and how it is written: the format :mod:`tasks.state.requests` keeps in Redis.

A :class:`Record` is one call as kept for whoever asks for it again (its item ids, how its answer is shaped, its
deadline, the API process running it and, once it finished, its :class:`Outcome`); a :class:`View` is a record
as Redis held it at one instant; :class:`Idempotency` is a caller's Idempotency-Key and the hash of what it asked.
Pure: no Redis here, so the format and its versioning are read and tested on their own.

**Versions.** :data:`FORMAT` is the record format this version writes and reads. A record this version cannot
read (damaged, or written in a newer format by a newer version during a rolling upgrade) is a
:class:`FormatError` saying why, never a record that fails later, in the middle of an answer; fields this version
does not know are ignored.

**Outcomes.** A failed call's outcome is its error's type and message (:mod:`tasks.errors`), and that is what
this version reads. Beside them it still writes the HTTP status its caller was answered with (``status_of``, the
web layer's table, handed to :class:`tasks.state.requests.Requests`), because versions from before errors were
types answer an idempotent retry with the status they read there; a record of theirs is read by its type alone.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tasks.errors import BatchingError

# A live first call writes its outcome as soon as it has its results, at its deadline at the latest; one that has
# not this long after its deadline never will (its write was lost), and its results decide.
OUTCOME_GRACE_S = 2.0
MAX_KEY_CHARS = 255  # an Idempotency-Key: 1-255 printable ASCII characters
# The record format this version writes and reads. Format 1 is written without a "v" field (so that a version from
# before the field reads it); a later format that changes what a field means writes its number, and this version
# then refuses the record rather than guess. Fields this version does not know are ignored.
FORMAT = 1


class FormatError(ValueError):
    """Raised by :meth:`Record.from_json` for a record this version cannot read; the message says what is wrong."""


_REQUIRED: Any = object()


def _field(d: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = _REQUIRED) -> Any:
    """``d[name]`` if it is one of ``kinds`` (a bool is no number), its default if absent; else FormatError."""
    if name not in d:
        if default is _REQUIRED:
            raise FormatError(f"no {name!r} field")
        return default
    value = d[name]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise FormatError(f"its {name!r} field is a {type(value).__name__}")
    return value


def _number(d: dict[str, Any], name: str, default: Any = _REQUIRED) -> float:
    """A finite number field: times and durations are compared and rendered, so inf or a 400-digit int is damage."""
    value = _field(d, name, (int, float), default)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise FormatError(f"its {name!r} field is not a finite number")
    return number


class State(StrEnum):
    """Where a recorded call stands, as ``GET /v1/requests/<id>`` reports it."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True)
class Shape:
    """How a call's answer is written: the route it came by, and what that route needs to rebuild it."""

    route: str = "infer"  # infer | completions | chat | embeddings
    single: bool = False  # native: one "input" (answered with "output") rather than "inputs"
    encoding: str = "float"  # embeddings: float or base64
    stream: bool = False
    choices: int = 1  # completions and chat: choices of each prompt (n), so usage counts each prompt once
    usage: bool = False  # a stream that asked for its usage chunk (stream_options.include_usage)
    echo: bool = False  # a completion that echoes its prompt (not kept: a resumed stream cannot send it)
    tier: str = ""  # completions and chat: the service_tier its answer says ("": the call asked for none)
    tool_calls: bool = False  # chat: its answers may hold tool calls (message.tool_calls, streamed as such)


def status_unknown(type_: str) -> int:
    """The status written beside a failure's type by a writer given no table (the CLI's gateway: it answers no
    HTTP caller); only versions from before errors were types read it."""
    return 500


@dataclass(frozen=True)
class Outcome:
    """How a call ended, as its caller was answered: in ``total_ms``, or failed with an error's type and message."""

    type: str = ""  # the error's (tasks.errors); empty: the call was answered
    message: str = ""
    total_ms: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.type)

    def stored(self, status_of: Callable[[str], int]) -> dict[str, Any]:
        """The outcome as written: with the status its caller was answered, for versions that read that."""
        return {"status": status_of(self.type) if self.failed else 200, **vars(self)}

    @classmethod
    def checked(cls, d: dict[str, Any]) -> Outcome:
        """An outcome as read back from a record (FormatError if damaged). The status, if written, is only
        checked: the type says whether and how the call failed (a failure without one is an internal error)."""
        status = _field(d, "status", (int,), 200)
        if not 100 <= status <= 599:
            raise FormatError(f"its outcome's status {status} is no HTTP status")
        type_ = _field(d, "type", (str,), "") or ("" if status == 200 else BatchingError.type)
        return cls(type_, _field(d, "message", (str,), ""), _number(d, "total_ms", 0.0))


@dataclass(frozen=True)
class Record:
    """One call, as kept for whoever asks for it again: enough to rebuild its answer from its items' results."""

    request_id: str
    tenant: str
    model: str
    items: tuple[str, ...]
    accepted_at: float  # shared clock (epoch seconds)
    deadline: float  # shared clock
    instance: str  # the API process that runs it (its admission lease says whether it is alive)
    shape: Shape = field(default_factory=Shape)
    outcome: Outcome | None = None
    # idempotent calls: written False with the claim, None ("perhaps sent") just before the publish, True once
    # RabbitMQ confirmed it; a claim whose call is still False and whose process is dead is taken over at once
    # (it never ran), one that is None is followed to its deadline (it may run); None too for records from before
    published: bool | None = None
    key_hash: str | None = None  # idempotent calls: sha256 of the key; the record then lives under the key

    def to_json(self, status_of: Callable[[str], int] = status_unknown) -> str:
        """The record as stored; ``status_of`` gives its outcome's HTTP status, for the versions that read it."""
        # vars(), not dataclasses.asdict: the fields are flat, and asdict's deep copies were 4% of an API process's CPU
        outcome = self.outcome.stored(status_of) if self.outcome else None
        d = {**vars(self), "shape": vars(self.shape), "outcome": outcome}
        if self.key_hash is None:  # as versions before the field wrote it: they can read it during an upgrade
            del d["key_hash"]
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Record:
        """The record, checked field by field: a damaged one (not JSON, a field missing or of the wrong type, a
        time that is not a finite number) or one in a newer format is a FormatError saying so, never a record
        that fails later, in the middle of an answer. Fields this version does not know are ignored."""
        try:
            d = json.loads(raw)
        except ValueError:  # UnicodeDecodeError too
            raise FormatError("it is not JSON") from None
        if not isinstance(d, dict):
            raise FormatError("it is not a JSON object")
        version = d.get("v", FORMAT)
        if version != FORMAT:
            newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT
            reads = f", newer than the format {FORMAT} this version reads" if newer else f"; this one reads {FORMAT}"
            raise FormatError(f"it is in format {version!r}{reads}")
        items = _field(d, "items", (list,))
        if not items or not all(isinstance(i, str) for i in items):
            raise FormatError("its 'items' field is not a list of item ids")
        shape, outcome = _field(d, "shape", (dict,), {}), _field(d, "outcome", (dict, type(None)), None)
        return cls(request_id=_field(d, "request_id", (str,)), tenant=_field(d, "tenant", (str,)),
                   model=_field(d, "model", (str,)), items=tuple(items), accepted_at=_number(d, "accepted_at"),
                   deadline=_number(d, "deadline"), instance=_field(d, "instance", (str,)),
                   shape=Shape(route=_field(shape, "route", (str,), "infer"),
                               single=_field(shape, "single", (bool,), False),
                               encoding=_field(shape, "encoding", (str,), "float"),
                               stream=_field(shape, "stream", (bool,), False),
                               choices=_field(shape, "choices", (int,), 1),
                               usage=_field(shape, "usage", (bool,), False),
                               echo=_field(shape, "echo", (bool,), False),
                               tier=_field(shape, "tier", (str,), ""),
                               tool_calls=_field(shape, "tool_calls", (bool,), False)),
                   outcome=None if outcome is None else Outcome.checked(outcome),
                   published=_field(d, "published", (bool, type(None)), None),
                   key_hash=_field(d, "key_hash", (str, type(None)), None))


@dataclass(frozen=True)
class View:
    """A record as Redis held it at one instant: how many of its items have a result, whether the API process
    running it is alive, and Redis's time then."""

    record: Record
    present: int
    alive: bool
    now: float

    @property
    def unanswered(self) -> bool:
        """Whoever ran the call will not write its outcome: its process died, or its deadline is long past."""
        return self.record.outcome is None and (not self.alive or self.now > self.record.deadline + OUTCOME_GRACE_S)

    @property
    def results_decide(self) -> bool:
        """Every item has a result and nobody will record the outcome: the results are the answer."""
        return self.unanswered and self.present == len(self.record.items)

    @property
    def expired(self) -> bool:
        """Nobody will answer it: its results never came and its deadline has passed."""
        return self.unanswered and self.present < len(self.record.items) and self.now > self.record.deadline


@dataclass(frozen=True)
class Idempotency:
    """An idempotent call's key (the caller's Idempotency-Key header) and the hash of what it asked."""

    key: str
    body_hash: str

    @classmethod
    def of(cls, key: str, route: str, body: Any) -> Idempotency:
        """The body is hashed as canonical JSON with its route: the same request however its bytes were laid out,
        and a different one on another route."""
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return cls(key, hashlib.sha256(f"{route}\n{canonical}".encode()).hexdigest())

    @property
    def key_hash(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()


def valid_key(key: str) -> bool:
    """Whether an Idempotency-Key header is usable: 1-255 printable ASCII characters."""
    return 0 < len(key) <= MAX_KEY_CHARS and all(" " <= c <= "~" for c in key)
