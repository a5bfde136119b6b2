"""Admission at the door, shared by every API process through Redis: quarantine check and four caps.

An item is admitted only if it fits under all of:

- the global cap of its priority class (``LLMB_ADMISSION_CAP`` for interactive items,
  ``LLMB_OFFLINE_ADMISSION_CAP`` for offline ones, so an offline backlog never closes the door to
  interactive callers);
- its model's cap: what that model's workers can answer within the caller's deadline
  (:func:`tasks.policy.capacity.deadline_cap`),
  so overload is refused at once rather than left to time out;
- its tenant's in-flight cap, so one tenant cannot take the whole system (the others are unaffected).

Each cap is a sorted set of the ids of admitted, unanswered items scored by their deadline; the model also has
a set scored by arrival time, for the age of its oldest waiting request (the autoscaling signal), and a
per-second arrival counter, for its arrival rate (refused calls count: they are demand the fleet missed).
Admission is one Lua call: refuse a quarantined input; forget members whose deadline has passed; admit all of
a call's items only if they fit.

**Time** inside the scripts is Redis's own (``TIME``), and deadlines are scored as Redis time plus the
caller's timeout: API hosts whose clocks disagree never purge each other's live admissions.

**Dead API processes.** Each API process holds a lease (a member of ``<key>:instances`` scored by its
expiry) and records what it admitted in its own hash, ``<key>:owner:<instance>`` (item id -> tenant, model,
class). Whoever renews a lease also reaps lapsed ones (:meth:`Admission.renew`): a process that died
releases what its callers held within ``api_lease_s``, not at their deadlines (an hour, for offline work).

The scripts are files in :mod:`tasks.state.lua`, their KEYS and ARGV built by name in
:mod:`tasks.state.admission_scripts`; the read-side report of each model's load (the autoscaling signals) is
:mod:`tasks.state.model_load`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import redis

from tasks.config import Settings
from tasks.policy.refusal import AdmissionVerdict
from tasks.schema import Priority
from tasks.state import admission_scripts as scripts
from tasks.state.keys import Keys
from tasks.state.lua import positional

NEVER = 1e18  # a valid_until that never comes


class Decision(NamedTuple):
    """An admission's verdict; when quarantined, the offending input's hash; when refused for room, how many
    items were ahead in the set that was full (what must drain first: the Retry-After)."""

    verdict: AdmissionVerdict
    bad_hash: str | None = None
    ahead: int = 0


@dataclass(frozen=True)
class Ticket:
    """Where a call's items were admitted: the sets to release them from."""

    tenant: str
    model: str
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True)
class AdmitCall:
    """One call to admit: all of its items or none, each until Redis's clock passes its now + ``timeout_s``
    (``now``, this host's clock, only names the arrival-rate bucket). ``model_cap``, ``tenant_cap``: those caps
    (None: the global interactive cap). ``tokens``: each item's estimated tokens (generation items; 0 or empty
    for others), admitted only while the model's admitted tokens stay within ``token_cap`` (0: no token budget):
    TOKENS_FULL.
    ``record``: (key, value, TTL) of the call's record, written only if the call is admitted."""

    item_ids: tuple[str, ...]
    hashes: tuple[str, ...]
    ticket: Ticket
    now: float
    timeout_s: float
    model_cap: int | None = None
    tenant_cap: int | None = None
    tokens: tuple[int, ...] = ()
    token_cap: int = 0
    record: tuple[str, str, int] | None = None


@dataclass(frozen=True)
class CollectCall:
    """One call's results to read (see :meth:`Admission.collect_many`)."""

    ticket: Ticket
    item_ids: tuple[str, ...]
    result_keys: tuple[str, ...]
    record: tuple[str, str] | None = None


def _decision(raw: bytes | str) -> Decision:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    verdict, _, detail = text.partition(":")
    if verdict == AdmissionVerdict.QUARANTINED:
        return Decision(AdmissionVerdict.QUARANTINED, bad_hash=detail)
    return Decision(AdmissionVerdict(verdict), ahead=int(detail or 0))


class Admission:
    """The admission sets of one namespace. ``instance`` names the API process admitting through it (its
    lease and owner hash); readers (CLI, metrics) leave it empty."""

    def __init__(self, client: redis.Redis, key: str, cap: int, quarantine_key: str, *, offline_cap: int = 0,
                 instance: str = "", lease_s: float = 5.0) -> None:
        self.client = client
        self.key = key
        self.arrivals_key = key + ":arrivals"
        self.offline_key = key + ":offline"
        self.leases_key = key + ":instances"
        self.quarantine_key = quarantine_key
        self.cap = cap
        self.offline_cap = offline_cap or cap
        self.instance = instance
        self.owner_key = f"{key}:owner:{instance}"
        self.lease_s = lease_s
        self._admit = client.register_script(scripts.ADMIT)
        self._collect = client.register_script(scripts.COLLECT)
        self._release = client.register_script(scripts.RELEASE)
        self._renew = client.register_script(scripts.RENEW)

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis, instance: str = "") -> Admission:
        """The admission sets; ``instance`` names an API process that admits (readers leave it empty)."""
        keys = Keys.from_settings(settings)
        return cls(client, keys.inflight, settings.admission.cap, keys.quarantine,
                   offline_cap=settings.admission.offline_cap, instance=instance,
                   lease_s=settings.admission.api_lease_s)

    def tenant_key(self, tenant: str) -> str:
        return f"{self.key}:t:{tenant}"

    def model_key(self, model: str) -> str:
        return f"{self.key}:m:{model}"

    def rate_key(self, model: str, second: int) -> str:
        """The model's arrival counter of one second (epoch, this host's clock)."""
        return f"{self.model_key(model)}:rate:{second}"

    def _sets(self, ticket: Ticket) -> scripts.ItemSets:
        model = self.model_key(ticket.model)
        offline = ticket.priority == Priority.OFFLINE
        return scripts.ItemSets(inflight=self.key, arrivals=self.arrivals_key, offline=self.offline_key,
                                tenant=self.tenant_key(ticket.tenant),
                                deadline=model + ":offline" if offline else model, model_arrivals=model + ":arrivals")

    def try_admit_many(self, calls: Sequence[AdmitCall], valid_until: float | None = None) -> list[Decision]:
        """Admit several calls in one round trip, one after the other in the script (a call admitted counts
        against the caps of those after it); a decision per call, in order. A call that reaches Redis after
        ``valid_until`` (Redis time: the caller has given up on the answer by then) is not admitted: LATE."""
        until = NEVER if valid_until is None else valid_until
        keys, args = scripts.admit_round([self._admit_arguments(call, until) for call in calls])
        return [_decision(raw) for raw in self._admit(keys=keys, args=args)]

    def _admit_arguments(self, call: AdmitCall, valid_until: float) -> tuple[scripts.AdmitKeys, scripts.AdmitArgs]:
        """One call's KEYS and ARGV, by name."""
        ticket, record = call.ticket, call.record
        model = self.model_key(ticket.model)
        keys = scripts.AdmitKeys(
            inflight=self.key, arrivals=self.arrivals_key, quarantine=self.quarantine_key,
            tenant=self.tenant_key(ticket.tenant), model=model, model_arrivals=model + ":arrivals",
            model_rate=self.rate_key(ticket.model, int(call.now)), model_offline=model + ":offline",
            offline=self.offline_key, owner=self.owner_key, leases=self.leases_key,
            record=record[0] if record else "")
        args = scripts.AdmitArgs(
            interactive_cap=self.cap, model_cap=self.cap if call.model_cap is None else call.model_cap,
            tenant_cap=self.cap if call.tenant_cap is None else call.tenant_cap, timeout_s=call.timeout_s,
            priority=ticket.priority, offline_cap=self.offline_cap,
            owner_entry=scripts.SEP.join((ticket.tenant, ticket.model, ticket.priority)), instance=self.instance,
            lease_s=self.lease_s, valid_until=valid_until, token_cap=call.token_cap,
            record_value=record[1] if record else "", record_ttl_s=record[2] if record else 0,
            item_ids=call.item_ids, hashes=call.hashes, tokens=call.tokens or (0,) * len(call.item_ids))
        return keys, args

    def collect_many(self, calls: Sequence[CollectCall]) -> list[tuple[list[bytes | None], bool]]:
        """Read several calls' result keys in one round trip: items that have a result stop counting against
        the caps, and each call's record (key, value as finished) is written when every result is in and none is
        an error; per call, in order: the values, and whether the record was written."""
        named = []
        for call in calls:
            key, value = call.record or ("", "")
            named.append((scripts.CollectKeys(self._sets(call.ticket), self.owner_key, key, call.result_keys),
                          scripts.CollectArgs(value, call.item_ids)))
        keys, args = scripts.collect_round(named)
        out = []
        for call, values in zip(calls, self._collect(keys=keys, args=args)):
            n = len(call.item_ids)
            out.append((list(values[:n]), len(values) > n))
        return out

    def release(self, ticket: Ticket, item_ids: Sequence[str]) -> None:
        if item_ids:
            self._release(keys=positional(scripts.ReleaseKeys(self._sets(ticket), self.owner_key)),
                          args=list(item_ids))

    def tokens_held(self, model: str) -> int:
        """Estimated tokens (prompt + max_tokens) of the model's admitted, unanswered generation items."""
        m = self.model_key(model)
        return sum(int(v or 0) for v in self.client.mget(m + ":kvsum", m + ":offline:kvsum"))

    def renew(self) -> int:
        """Renew this process's lease; release what processes whose lease lapsed had admitted (returns how many
        items). Called every ``lease_s / 3`` by each API process."""
        return self._reap(self.instance)

    def reap(self) -> int:
        """Release what processes whose lease lapsed had admitted, holding no lease (the batcher does this at
        every tick, so capacity comes back even when no API process is left to reap: the only API host cut
        off, say)."""
        return self._reap("")

    def _reap(self, instance: str) -> int:
        args = positional(scripts.RenewArgs(instance=instance, lease_s=self.lease_s, prefix=self.key))
        return int(self._renew(keys=[self.leases_key], args=args))

    def in_flight(self, now: float) -> int:
        return int(self.client.zcount(self.key, now, "+inf"))

    def tenant_in_flight(self, tenant: str, now: float) -> int:
        return int(self.client.zcount(self.tenant_key(tenant), now, "+inf"))

    def tenants_in_flight(self, tenants: list[str], now: float) -> list[int]:
        """:meth:`tenant_in_flight` of many tenants in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for tenant in tenants:
            pipe.zcount(self.tenant_key(tenant), now, "+inf")
        return [int(n) for n in pipe.execute()]

    def oldest_arrival(self) -> float | None:
        """Arrival time (epoch) of the oldest admitted, unanswered item, if any."""
        oldest = self.client.zrange(self.arrivals_key, 0, 0, withscores=True)
        return float(oldest[0][1]) if oldest else None
