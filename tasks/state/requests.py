"""Calls by id, and Idempotency-Key claims: what lets a caller read a call again, or retry it without a second run.

Two kinds of key, both living as long as results do (``LLMB_RESULT_TTL_S`` after the call finished):

* ``<ns>:request:<tenant>:<request id>``: the call's :class:`Record` (its item ids, how its answer is shaped,
  its deadline, the API process running it and, once it finished, its :class:`Outcome`), written when it is
  admitted; ``GET /v1/requests/<id>`` reads it. The tenant is part of the key, so another tenant's lookup
  simply finds nothing.
* ``<ns>:idem:<tenant>:<sha256(Idempotency-Key)>``: the claim of an idempotent call: the hash of its body and the
  record it names. One Lua call (:meth:`Requests.claim`) either claims a free key, writing the claim and the
  call's record together, or returns what the key names, with how many of its items have a result and whether
  the API process that runs it still holds its lease, all read at one instant.

The answer itself is never copied: results stay in the workers' result keys (by item id), so whoever reads a
record (another API process, after the first one was killed) rebuilds the same answer from them; a finished
call's record expires with its first result. A call
refused before it was published is forgotten (:meth:`Requests.release`), so a retry with its key runs; so does a
retry of a call whose process died after claiming its key and before publishing it (its record says it was never
published; the mark is written just after the publish is confirmed, so a process that dies in that millisecond
can have its call run twice).
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
from tasks.schema import ItemResult
from tasks.state.keys import Keys

# A live first call writes its outcome as soon as it has its results, at its deadline at the latest; one that has
# not this long after its deadline never will (its write was lost), and its results decide.
OUTCOME_GRACE_S = 2.0
MAX_KEY_CHARS = 255  # an Idempotency-Key: 1-255 printable ASCII characters

_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""

# The state of one record (its JSON): items with a result, and whether the API process running it is alive.
_VIEW = _NOW + """
local function view(record, results, leases)
  local r = cjson.decode(record)
  local present = 0
  for _, id in ipairs(r.items) do present = present + redis.call('EXISTS', results .. id) end
  local lease = redis.call('ZSCORE', leases, r.instance)
  local alive = 0
  if lease and tonumber(lease) > now then alive = 1 end
  return {record, present, alive, tostring(now)}
end
"""

# KEYS: 1 the idempotency key, 2 this call's record, 3 the API processes' leases
# ARGV: 1 the claim (JSON: body hash, request id, first item id), 2 this call's record (JSON), 3 TTL (s),
#       4 prefix of the tenant's record keys, 5 prefix of result keys
#       6 'peek' to only look (KEYS[2] and ARGV[2] unused)
# Returns {'claimed'} ({'free'} for a peek), or {'held', claim, record, items with a result, 1 if its API process
# is alive, Redis time}. A key whose record is gone (expired, or replaced by a later call reusing its request id),
# or whose call was never published and whose process is dead, is free again.
_CLAIM = _VIEW + """
local held = redis.call('GET', KEYS[1])
if held then
  local claim = cjson.decode(held)
  local record = redis.call('GET', ARGV[4] .. claim.request_id)
  if record and cjson.decode(record).items[1] == claim.item then
    local found = view(record, ARGV[5], KEYS[3])
    -- a call whose process died before publishing it will never run: its key is free again
    local never = cjson.decode(record).published == false and found[3] == 0
    if not never then return {'held', held, found[1], found[2], found[3], found[4]} end
  end
end
if ARGV[6] == 'peek' then return {'free'} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return {'claimed'}
"""

# KEYS: 1 a record, 2 leases; ARGV: 1 prefix of result keys. Returns the view of the record, or nil.
_LOOK = _VIEW + """
local record = redis.call('GET', KEYS[1])
if not record then return nil end
return view(record, ARGV[1], KEYS[2])
"""

# KEYS: 1 the idempotency key ('' for none), 2 the record; ARGV: 1 the claim. Forgets a call refused before it ran:
# its record, and its claim if the key still holds it.
_RELEASE = """
if KEYS[1] ~= '' and redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('DEL', KEYS[2])
return 1
"""


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

    def to_json(self) -> str:
        # vars(), not dataclasses.asdict: the fields are flat, and asdict's deep copies were 4% of an API process's CPU
        return json.dumps({**vars(self), "shape": vars(self.shape),
                           "outcome": vars(self.outcome) if self.outcome else None})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Record:
        d = json.loads(raw)
        outcome = d.pop("outcome")
        return cls(**{**d, "items": tuple(d["items"]), "shape": Shape(**d["shape"]),
                      "outcome": Outcome(**outcome) if outcome else None})


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


class Requests:
    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int, leases_key: str) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.leases_key = leases_key
        self._claim = client.register_script(_CLAIM)
        self._look = client.register_script(_LOOK)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> Requests:
        keys = Keys.from_settings(settings)
        return cls(client, keys, settings.result_ttl_s, keys.inflight + ":instances")

    def _ttl(self, record: Record, now: float) -> int:
        """Until the result TTL after the call's deadline (it is rewritten, shorter, when the call finishes)."""
        return self.ttl_s + max(1, math.ceil(record.deadline - now))

    def _idem_key(self, tenant: str, idem: Idempotency) -> str:
        return self.keys.idempotency(tenant, idem.key_hash)

    @staticmethod
    def _claim_value(record: Record, idem: Idempotency) -> str:
        return json.dumps({"body": idem.body_hash, "request_id": record.request_id, "item": record.items[0]})

    def claim(self, record: Record, idem: Idempotency, now: float) -> Claim:
        """Claim ``idem``'s key for the call ``record`` describes (writing the record with it), or see the call it
        already names."""
        return self._claimed(self._claim(
            keys=[self._idem_key(record.tenant, idem), self.keys.request(record.tenant, record.request_id),
                  self.leases_key],
            args=[self._claim_value(record, idem), record.to_json(), self._ttl(record, now),
                  self.keys.request(record.tenant, ""), self.keys.result(""), ""]), idem)

    def peek(self, tenant: str, idem: Idempotency) -> Claim:
        """The call ``idem``'s key names, as :meth:`claim` sees it, without claiming a free key (``view`` None)."""
        return self._claimed(self._claim(
            keys=[self._idem_key(tenant, idem), "", self.leases_key],
            args=["", "", 0, self.keys.request(tenant, ""), self.keys.result(""), "peek"]), idem)

    @staticmethod
    def _claimed(found: list[Any], idem: Idempotency) -> Claim:
        if found[0] in (b"claimed", b"free"):
            return Claim()
        _, held, raw, present, alive, redis_now = found
        return Claim(view=View(Record.from_json(raw), int(present), bool(int(alive)), float(redis_now)),
                     same_body=json.loads(held)["body"] == idem.body_hash)

    def admitted(self, record: Record, now: float) -> tuple[str, str, int]:
        """The write that records a call without an idempotency key: (key, value, TTL), for the admission script
        to make with the admission itself."""
        return self.keys.request(record.tenant, record.request_id), record.to_json(), self._ttl(record, now)

    def finished(self, record: Record, outcome: Outcome) -> tuple[str, str]:
        """The record as finished (key, value), for the script that collects its results to write with them."""
        return self.keys.request(record.tenant, record.request_id), replace(record, outcome=outcome).to_json()

    def finish(self, record: Record, outcome: Outcome, idem: Idempotency | None, now: float,
               results_written_at: float | None = None) -> None:
        """Record how the call ended. The record (and its claim) then lives ``ttl_s``, or, when the answer is
        rebuilt from results, as long as its first result does (``results_written_at``: when the worker wrote
        it), so that a record never outlives what it answers with."""
        ttl = self.ttl_s if results_written_at is None else self.ttl_s - (now - results_written_at)
        ttl_s = max(1, math.floor(ttl))
        done = replace(record, outcome=outcome).to_json()
        if idem is None:
            self.client.set(self.keys.request(record.tenant, record.request_id), done, ex=ttl_s)
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.request(record.tenant, record.request_id), done, ex=ttl_s)
        pipe.expire(self._idem_key(record.tenant, idem), ttl_s)
        pipe.execute()

    def published(self, records: Sequence[Record]) -> None:
        """Mark idempotent calls' records (one round trip): their requests are in RabbitMQ, so a retry waits for
        them to be answered."""
        pipe = self.client.pipeline(transaction=False)
        for record in records:
            pipe.set(self.keys.request(record.tenant, record.request_id), replace(record, published=True).to_json(),
                     keepttl=True)
        pipe.execute()

    def release(self, record: Record, idem: Idempotency | None) -> None:
        """Forget a call that did not run (refused, or a stream whose caller went away), and free its key."""
        self._release(keys=[self._idem_key(record.tenant, idem) if idem else "",
                            self.keys.request(record.tenant, record.request_id)],
                      args=[self._claim_value(record, idem) if idem else ""])

    def look(self, tenant: str, request_id: str) -> View | None:
        """The tenant's call of this id, as it stands now (None: unknown to this tenant, or expired)."""
        found = self._look(keys=[self.keys.request(tenant, request_id), self.leases_key], args=[self.keys.result("")])
        if not found:
            return None
        raw, present, alive, redis_now = found
        return View(Record.from_json(raw), int(present), bool(int(alive)), float(redis_now))

    def results(self, record: Record) -> list[ItemResult | None]:
        """Every item's result, in order (None where it has none, or it expired)."""
        raw = self.client.mget([self.keys.result(i) for i in record.items])
        return [ItemResult.from_dict(json.loads(r)) if r is not None else None for r in raw]
