"""Calls by id, and Idempotency-Key claims, in Redis: what lets a caller read a call again, or retry it without a
second run. The records' format (:class:`Record`, :class:`View`, :class:`Idempotency`) is :mod:`tasks.state.records`;
the scripts are files in :mod:`tasks.state.lua` (``requests_*.lua``), each listing its KEYS and ARGV.

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

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis

from tasks.config import Settings
from tasks.errors import RecordUnreadable
from tasks.schema import ItemResult
from tasks.state.keys import Keys
from tasks.state.lua import positional, source
from tasks.state.records import FormatError, Idempotency, Outcome, Record, View, status_unknown

_CLAIM = source("requests_claim", "now", "requests_readable", "requests_view", "requests_resolve")
_LOOK = source("requests_look", "now", "requests_readable", "requests_view", "requests_resolve")
_RELEASE = source("requests_release")
_UPDATE = source("requests_update")


@dataclass(frozen=True)
class ClaimKeys:
    """KEYS of ``requests_claim.lua``, in order ('' where a peek does not write)."""

    idempotency: str  # the claim
    record: str  # the record the claim names
    leases: str  # the API processes' leases
    request: str  # the call's request-id key (for the pointer)


@dataclass(frozen=True)
class ClaimArgs:
    """ARGV of ``requests_claim.lua``, in order."""

    claim: str  # JSON: body hash, request id, first item id, record key ('' for a peek)
    record: str  # the call's record, JSON ('' for a peek)
    ttl_s: int  # of the claim, the record and the pointer
    request_prefix: str  # of the tenant's request-id keys
    result_prefix: str  # of result keys
    mode: str  # 'peek' to only look, '' to claim
    pointer: str  # JSON {at, item}, for the request-id key ('' for a peek)


@dataclass(frozen=True)
class UpdateArgs:
    """ARGV of ``requests_update.lua`` (its KEYS: the record, its claim or '')."""

    record: str  # the record to write, JSON
    item: str  # the call's first item id
    ttl_s: int | str  # for the record and its claim; '' to keep the record's TTL


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
    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int, leases_key: str,
                 status_of: Callable[[str], int] = status_unknown) -> None:
        self.client = client
        self.status_of = status_of  # an outcome's HTTP status, written for versions from before errors were types
        self.keys = keys
        self.ttl_s = ttl_s
        self.leases_key = leases_key
        self._claim = client.register_script(_CLAIM)
        self._look = client.register_script(_LOOK)
        self._release = client.register_script(_RELEASE)
        self._update = client.register_script(_UPDATE)

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis,
                      status_of: Callable[[str], int] = status_unknown) -> Requests:
        keys = Keys.from_settings(settings)
        return cls(client, keys, settings.stores.result_ttl_s, keys.inflight + ":instances", status_of)

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
        keys = ClaimKeys(idempotency=self._idem_key(record.tenant, idem), record=at, leases=self.leases_key,
                         request=self.keys.request(record.tenant, record.request_id))
        args = ClaimArgs(claim=self._claim_value(record, idem), record=record.to_json(), ttl_s=self._ttl(record, now),
                         request_prefix=self.keys.request(record.tenant, ""), result_prefix=self.keys.result(""),
                         mode="", pointer=json.dumps({"at": at, "item": record.items[0]}))
        return self._claimed(self._claim(keys=positional(keys), args=positional(args)), idem)

    def peek(self, tenant: str, idem: Idempotency) -> Claim:
        """The call ``idem``'s key names, as :meth:`claim` sees it, without claiming a free key (``view`` None)."""
        keys = ClaimKeys(idempotency=self._idem_key(tenant, idem), record="", leases=self.leases_key, request="")
        args = ClaimArgs(claim="", record="", ttl_s=0, request_prefix=self.keys.request(tenant, ""),
                         result_prefix=self.keys.result(""), mode="peek", pointer="")
        return self._claimed(self._claim(keys=positional(keys), args=positional(args)), idem)

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
        return self.record_key(record), replace(record, outcome=outcome).to_json(self.status_of)

    def finish(self, record: Record, outcome: Outcome, idem: Idempotency | None, now: float,
               results_written_at: float | None = None) -> None:
        """Record how the call ended. The record (and its claim) then lives ``ttl_s``, or, when the answer is
        rebuilt from results, as long as its first result does (``results_written_at``: when the worker wrote
        it), so that a record never outlives what it answers with."""
        ttl = self.ttl_s if results_written_at is None else self.ttl_s - (now - results_written_at)
        ttl_s = max(1, math.floor(ttl))
        done = replace(record, outcome=outcome).to_json(self.status_of)
        if idem is None:
            self.client.set(self.record_key(record), done, ex=ttl_s)
            return
        self._update(keys=[self.record_key(record), self._idem_key(record.tenant, idem)],
                     args=positional(UpdateArgs(record=done, item=record.items[0], ttl_s=ttl_s)))

    def published(self, records: Sequence[Record], *, sending: bool = False) -> list[bool | None]:
        """Mark idempotent calls' records (one round trip): their requests are in RabbitMQ (or, ``sending``, about
        to be sent and perhaps there), so a retry waits for them to be answered. The mark before the publish is
        what makes a key safe to take over: a record still unmarked was never sent; one marked "sending" whose
        process died may have been, and a retry follows it up to its deadline rather than running it twice. Per
        record, whether it was still its call's: True, False (a retry took its key over while this process
        stalled) or None (the record is gone: Redis lost it, as in a restart; nobody took the key over)."""
        pipe = self.client.pipeline(transaction=False)
        for record in records:
            marked = replace(record, published=None if sending else True)
            args = UpdateArgs(record=marked.to_json(), item=record.items[0], ttl_s="")
            self._update(keys=[self.record_key(record), ""], args=positional(args), client=pipe)
        return [None if int(written) < 0 else bool(written) for written in pipe.execute()]

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
