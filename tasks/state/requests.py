"""Calls by id, and Idempotency-Key claims: what lets a caller read a call again, or retry it without a second run.

Three kinds of key, all living as long as results do (``LLMB_RESULT_TTL_S`` after the call finished):

* ``<ns>:idem:<tenant>:<sha256(Idempotency-Key)>``: the claim of an idempotent call: the hash of its body, and the
  key of its record. One Lua call (:meth:`Requests.claim`) either claims a free key, writing the claim and the
  call's record together, or returns what the key names, with how many of its items have a result and whether
  the API process that runs it still holds its lease, all read at one instant.
* ``<ns>:idem:<tenant>:<sha256(Idempotency-Key)>:record``: that call's :class:`Record` (its item ids, how its answer
  is shaped, its deadline, the API process running it and, once it finished, its :class:`Outcome`). It is keyed by
  (tenant, key) and by nothing the caller chose for another purpose: proxies and tracers reuse X-Request-Id values,
  and a key's promise (one run, one answer) must not depend on them.
* ``<ns>:request:<tenant>:<request id>``: what ``GET /v1/requests/<id>`` reads: the record of a call without a key,
  or a pointer to the record of one with a key. A request id reused by the same tenant names its latest call; the
  tenant is part of the key, so another tenant's lookup simply finds nothing.

The answer itself is never copied: results stay in the workers' result keys (by item id), so whoever reads a
record (another API process, after the first one was killed) rebuilds the same answer from them; a finished
call's record expires with its first result. A call refused before it was published is forgotten
(:meth:`Requests.release`), so a retry with its key runs; so does a retry of a call whose process died after
claiming its key and before publishing it (its record says it was never published; the mark is written just after
the publish is confirmed, so a process that dies in that millisecond can have its call run twice).

A record this version cannot read (damaged, or written in a newer format by a newer version during a rolling
upgrade) is :class:`tasks.errors.RecordUnreadable` for whoever asks for it, never taken for a free key: the call
may have run, so its key is not run again.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import redis

from tasks.config import Settings
from tasks.errors import RecordUnreadable
from tasks.schema import ItemResult
from tasks.state.keys import Keys

# A live first call writes its outcome as soon as it has its results, at its deadline at the latest; one that has
# not this long after its deadline never will (its write was lost), and its results decide.
OUTCOME_GRACE_S = 2.0
MAX_KEY_CHARS = 255  # an Idempotency-Key: 1-255 printable ASCII characters
# The record format this version writes and reads. Format 1 is written without a "v" field (so that a version from
# before the field reads it); a later format that changes what a field means writes its number, and this version
# then refuses the record rather than guess. Fields this version does not know are ignored.
FORMAT = 1

_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""

# A record's JSON decoded, or nil when it lacks what the scripts read (not JSON, no non-empty list of item ids, or
# no instance): the caller is told it cannot be read, rather than the script failing as if Redis were away.
_READABLE = """
local function readable(raw)
  local ok, r = pcall(cjson.decode, raw)
  if not ok or type(r) ~= 'table' or type(r.items) ~= 'table' or type(r.instance) ~= 'string' then return nil end
  if type(r.items[1]) ~= 'string' then return nil end  -- no list of item ids (an object, or an empty list)
  for _, id in ipairs(r.items) do if type(id) ~= 'string' then return nil end end
  return r
end
"""

# The record a request-id key names: its own value, or, for a pointer (a call with an Idempotency-Key), the record
# under its key, while that is still the same call's (nil once it is not: expired, or the key claimed anew).
_RESOLVE = """
local function resolve(raw)
  local ok, p = pcall(cjson.decode, raw)
  if not ok or type(p) ~= 'table' or type(p.at) ~= 'string' then return raw end
  local record = redis.call('GET', p.at)
  if not record then return nil end
  local r = readable(record)
  if r and r.items[1] ~= p.item then return nil end
  return record
end
"""

# The state of one record (its JSON): items with a result (-1: the record cannot be read), and whether the API
# process running it is alive.
_VIEW = _NOW + _READABLE + """
local function view(record, results, leases)
  local r = readable(record)
  if not r then return {record, -1, 0, tostring(now)} end
  local present = 0
  for _, id in ipairs(r.items) do present = present + redis.call('EXISTS', results .. id) end
  local lease = redis.call('ZSCORE', leases, r.instance)
  local alive = 0
  if lease and tonumber(lease) > now then alive = 1 end
  return {record, present, alive, tostring(now)}
end
"""

# KEYS: 1 the idempotency key, 2 the record it will name, 3 the API processes' leases, 4 the call's request-id key
# ARGV: 1 the claim (JSON: body hash, request id, first item id, record key), 2 this call's record (JSON), 3 TTL (s),
#       4 prefix of the tenant's request-id keys, 5 prefix of result keys, 6 'peek' to only look (KEYS 2 and 4,
#       ARGV 1, 2 and 7 unused), 7 the pointer to the record, for the request-id key
# Returns {'claimed'} ({'free'} for a peek); {'held', claim, record, items with a result (-1: the record cannot be
# read), 1 if its API process is alive, Redis time}; or {'unreadable', claim} when the claim cannot be read. A key
# whose record is gone (expired, or released), or whose call was never published and whose process is dead, is
# free again. A claim written before records lived under their key names its record by request id.
_CLAIM = _VIEW + _RESOLVE + """
local held = redis.call('GET', KEYS[1])
if held then
  local ok, claim = pcall(cjson.decode, held)
  if not ok or type(claim) ~= 'table' or type(claim.item) ~= 'string' then return {'unreadable', held} end
  local record
  local own = type(claim.record) == 'string'
  if own then
    record = redis.call('GET', claim.record)
  else
    record = redis.call('GET', ARGV[4] .. tostring(claim.request_id))
    if record then record = resolve(record) end
  end
  if record then
    local r = readable(record)
    -- under its key, a record is written with its claim and rewritten only while it is its claim's call: another
    -- call's there is damage, as an unreadable one is (by request id it is a later call's: the key is free)
    if not r or (own and r.items[1] ~= claim.item) then return {'held', held, record, -1, 0, tostring(now)} end
    if r.items[1] == claim.item then
      local found = view(record, ARGV[5], KEYS[3])
      -- a call whose process died before publishing it will never run: its key is free again
      local never = r.published == false and found[3] == 0
      if not never then return {'held', held, found[1], found[2], found[3], found[4]} end
    end
  end
end
if ARGV[6] == 'peek' then return {'free'} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('SET', KEYS[4], ARGV[7], 'EX', ARGV[3])
return {'claimed'}
"""

# KEYS: 1 an idempotent call's record, 2 its claim; ARGV: 1 the record (JSON), 2 its first item id, 3 TTL (s) for both,
# '' to keep the record's. Rewrites the record (and sets its claim's TTL) only while it is still this call's: a call
# whose process stalled past its lease before publishing may have had its key taken over by a retry meanwhile.
_UPDATE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, r = pcall(cjson.decode, raw)
if not ok or type(r) ~= 'table' or type(r.items) ~= 'table' or r.items[1] ~= ARGV[2] then return 0 end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
else
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return 1
"""

# KEYS: 1 a request-id key, 2 leases; ARGV: 1 prefix of result keys. Returns the view of the record it names, or nil.
_LOOK = _VIEW + _RESOLVE + """
local raw = redis.call('GET', KEYS[1])
if not raw then return nil end
local record = resolve(raw)
if not record then return nil end
return view(record, ARGV[1], KEYS[2])
"""

# KEYS: 1 the idempotency key ('' for none), 2 the call's record, 3 its request-id key (2 again without a key);
# ARGV: 1 the call's first item id. Forgets a call refused before it ran: its claim, its record and what its request
# id names, each only while it still names this call (a retry may have claimed the key, a later call reused the id;
# a claim written by an earlier version names it the same way, by its first item).
_RELEASE = """
local function mine(key)
  if key == '' then return false end
  local raw = redis.call('GET', key)
  if not raw then return false end
  local ok, r = pcall(cjson.decode, raw)
  if not ok or type(r) ~= 'table' then return false end
  return (type(r.items) == 'table' and r.items[1] == ARGV[1]) or r.item == ARGV[1]
end
for i = 1, 3 do
  if mine(KEYS[i]) then redis.call('DEL', KEYS[i]) end
end
return 1
"""


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


@dataclass(frozen=True)
class Outcome:
    """How a call ended, as its caller was answered: 200 with ``total_ms``, or an error's status, type, message."""

    status: int
    type: str = ""
    message: str = ""
    total_ms: float = 0.0

    @classmethod
    def checked(cls, d: dict[str, Any]) -> Outcome:
        """An outcome as read back from a record (FormatError if damaged: its status is an answer's status)."""
        status = _field(d, "status", (int,))
        if not 100 <= status <= 599:
            raise FormatError(f"its outcome's status {status} is no HTTP status")
        return cls(status, _field(d, "type", (str,), ""), _field(d, "message", (str,), ""),
                   _number(d, "total_ms", 0.0))


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
    # idempotent calls: written False with the claim, True once the request is in RabbitMQ; a claim whose call
    # was never published and whose process is dead is taken over at once, not waited on until its deadline
    published: bool | None = None
    key_hash: str | None = None  # idempotent calls: sha256 of the key; the record then lives under the key

    def to_json(self) -> str:
        # vars(), not dataclasses.asdict: the fields are flat, and asdict's deep copies were 4% of an API process's CPU
        d = {**vars(self), "shape": vars(self.shape), "outcome": vars(self.outcome) if self.outcome else None}
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
                               stream=_field(shape, "stream", (bool,), False)),
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


@dataclass(frozen=True)
class Claim:
    """What :meth:`Requests.claim` found: the key was free and is now this call's (``view`` None), or it names an
    earlier call (its view, and whether the body was the same)."""

    view: View | None = None
    same_body: bool = True

    @property
    def claimed(self) -> bool:
        return self.view is None


def _unreadable_key(request_id: str | None, reason: str) -> RecordUnreadable:
    """What a retry hears when the call its key names cannot be read: it is not run again, and how to go on."""
    which = f" (request {request_id!r})" if request_id else ""
    return RecordUnreadable(
        f"the call this Idempotency-Key names{which} is recorded in a form this server cannot read ({reason}): "
        "written by a newer version of the service, or damaged. It may have run, so it is not run again on this key: "
        "retry once a rolling upgrade has finished, or send it with a new Idempotency-Key to run it anew")


def _unreadable_request(request_id: str, reason: str) -> RecordUnreadable:
    return RecordUnreadable(
        f"request {request_id!r} is recorded in a form this server cannot read ({reason}): written by a newer "
        "version of the service, or damaged; ask again once a rolling upgrade has finished")


class Requests:
    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int, leases_key: str) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.leases_key = leases_key
        self._claim = client.register_script(_CLAIM)
        self._look = client.register_script(_LOOK)
        self._release = client.register_script(_RELEASE)
        self._update = client.register_script(_UPDATE)

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> Requests:
        keys = Keys.from_settings(settings)
        return cls(client, keys, settings.result_ttl_s, keys.inflight + ":instances")

    def _ttl(self, record: Record, now: float) -> int:
        """Until the result TTL after the call's deadline (it is rewritten, shorter, when the call finishes)."""
        return self.ttl_s + max(1, math.ceil(record.deadline - now))

    def _idem_key(self, tenant: str, idem: Idempotency) -> str:
        return self.keys.idempotency(tenant, idem.key_hash)

    def record_key(self, record: Record) -> str:
        """Where a call's record lives: under its Idempotency-Key if it has one, else under its request id."""
        if record.key_hash is not None:
            return self.keys.idempotent_record(record.tenant, record.key_hash)
        return self.keys.request(record.tenant, record.request_id)

    def _claim_value(self, record: Record, idem: Idempotency) -> str:
        return json.dumps({"body": idem.body_hash, "request_id": record.request_id, "item": record.items[0],
                           "record": self.record_key(record)})

    def claim(self, record: Record, idem: Idempotency, now: float) -> Claim:
        """Claim ``idem``'s key for the call ``record`` describes (writing the record with it, under the key, and a
        pointer to it under its request id for ``GET /v1/requests/<id>``), or see the call it already names.
        ``record`` must be keyed (``replace(record, key_hash=idem.key_hash)``): later writes find it by that."""
        if record.key_hash != idem.key_hash:
            raise ValueError("claim with a record keyed to this Idempotency-Key (replace(record, key_hash=...))")
        at = self.record_key(record)
        return self._claimed(self._claim(
            keys=[self._idem_key(record.tenant, idem), at, self.leases_key,
                  self.keys.request(record.tenant, record.request_id)],
            args=[self._claim_value(record, idem), record.to_json(), self._ttl(record, now),
                  self.keys.request(record.tenant, ""), self.keys.result(""), "",
                  json.dumps({"at": at, "item": record.items[0]})]), idem)

    def peek(self, tenant: str, idem: Idempotency) -> Claim:
        """The call ``idem``'s key names, as :meth:`claim` sees it, without claiming a free key (``view`` None)."""
        return self._claimed(self._claim(
            keys=[self._idem_key(tenant, idem), "", self.leases_key, ""],
            args=["", "", 0, self.keys.request(tenant, ""), self.keys.result(""), "peek", ""]), idem)

    @staticmethod
    def _claimed(found: list[Any], idem: Idempotency) -> Claim:
        if found[0] in (b"claimed", b"free"):
            return Claim()
        if found[0] == b"unreadable":
            raise _unreadable_key(None, "its claim is not the JSON this version writes")
        _, held, raw, present, alive, redis_now = found
        claim = json.loads(held)  # the script decoded it: JSON with an item id
        request_id = claim.get("request_id") if isinstance(claim.get("request_id"), str) else None
        try:
            record = Record.from_json(raw)
            if int(present) < 0:  # the script could not read it
                raise FormatError("it lacks its item ids or its API process")
        except FormatError as exc:
            raise _unreadable_key(request_id, str(exc)) from None
        return Claim(view=View(record, int(present), bool(int(alive)), float(redis_now)),
                     same_body=claim.get("body") == idem.body_hash)

    def admitted(self, record: Record, now: float) -> tuple[str, str, int]:
        """The write that records a call without an idempotency key: (key, value, TTL), for the admission script
        to make with the admission itself."""
        return self.record_key(record), record.to_json(), self._ttl(record, now)

    def finished(self, record: Record, outcome: Outcome) -> tuple[str, str]:
        """The record as finished (key, value), for the script that collects its results to write with them."""
        return self.record_key(record), replace(record, outcome=outcome).to_json()

    def finish(self, record: Record, outcome: Outcome, idem: Idempotency | None, now: float,
               results_written_at: float | None = None) -> None:
        """Record how the call ended. The record (and its claim) then lives ``ttl_s``, or, when the answer is
        rebuilt from results, as long as its first result does (``results_written_at``: when the worker wrote
        it), so that a record never outlives what it answers with."""
        ttl = self.ttl_s if results_written_at is None else self.ttl_s - (now - results_written_at)
        ttl_s = max(1, math.floor(ttl))
        done = replace(record, outcome=outcome).to_json()
        if idem is None:
            self.client.set(self.record_key(record), done, ex=ttl_s)
            return
        self._update(keys=[self.record_key(record), self._idem_key(record.tenant, idem)],
                     args=[done, record.items[0], ttl_s])

    def published(self, records: Sequence[Record]) -> None:
        """Mark idempotent calls' records (one round trip): their requests are in RabbitMQ, so a retry waits for
        them to be answered."""
        pipe = self.client.pipeline(transaction=False)
        for record in records:
            self._update(keys=[self.record_key(record), ""], args=[replace(record, published=True).to_json(),
                                                                   record.items[0], ""], client=pipe)
        pipe.execute()

    def release(self, record: Record, idem: Idempotency | None) -> None:
        """Forget a call that did not run (refused, or a stream whose caller went away), and free its key; what
        another call wrote meanwhile under the same request id stays."""
        self._release(keys=[self._idem_key(record.tenant, idem) if idem else "", self.record_key(record),
                            self.keys.request(record.tenant, record.request_id)],
                      args=[record.items[0]])

    def look(self, tenant: str, request_id: str) -> View | None:
        """The tenant's latest call of this id, as it stands now (None: unknown to this tenant, or expired)."""
        found = self._look(keys=[self.keys.request(tenant, request_id), self.leases_key], args=[self.keys.result("")])
        if not found:
            return None
        raw, present, alive, redis_now = found
        try:
            record = Record.from_json(raw)
            if int(present) < 0:
                raise FormatError("it lacks its item ids or its API process")
        except FormatError as exc:
            raise _unreadable_request(request_id, str(exc)) from None
        return View(record, int(present), bool(int(alive)), float(redis_now))

    def results(self, record: Record) -> list[ItemResult | None]:
        """Every item's result, in order (None where it has none, or it expired)."""
        raw = self.client.mget([self.keys.result(i) for i in record.items])
        try:
            return [ItemResult.from_dict(json.loads(r)) if r is not None else None for r in raw]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise _unreadable_request(record.request_id, f"a result of it cannot be read: {type(exc).__name__}") \
                from None
