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
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

import redis

from tasks.config import Settings
from tasks.policy.capacity import recommended_workers
from tasks.schema import Priority, WorkerInfo
from tasks.state.keys import Keys

RATE_WINDOW_S = 10  # the arrival rate is the mean over this many whole seconds
NEVER = 1e18  # a valid_until that never comes
SEP = "\t"  # between tenant, model and class in an owner hash's values (none of them can hold a tab)

_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""

# A model's deadline set S (interactive or offline) keeps, for its generation items, their estimated tokens in
# the hash S:kv and their sum in S:kvsum: what the model's token budget is checked against. forget(S, id) drops
# an item's tokens wherever the item leaves S.
_FORGET = """
local function forget(set, id)
  local t = redis.call('HGET', set .. ':kv', id)
  if t then
    redis.call('HDEL', set .. ':kv', id)
    redis.call('DECRBY', set .. ':kvsum', t)
  end
end
"""

# Forget expired members of a deadline set (and their tokens) and of its arrival set. KEYS: set by deadline, set
# by arrival or ''.
_PURGE = _NOW + """
local function purge(by_deadline, by_arrival)
  local expired = redis.call('ZRANGEBYSCORE', by_deadline, '-inf', now)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', by_deadline, '-inf', now)
    for i = 1, #expired, 1000 do
      local chunk = {unpack(expired, i, math.min(i + 999, #expired))}
      if by_arrival ~= '' then redis.call('ZREM', by_arrival, unpack(chunk)) end
      local held, gone = redis.call('HMGET', by_deadline .. ':kv', unpack(chunk)), 0
      for j = 1, #chunk do if held[j] then gone = gone + tonumber(held[j]) end end
      if gone > 0 then
        redis.call('HDEL', by_deadline .. ':kv', unpack(chunk))
        redis.call('DECRBY', by_deadline .. ':kvsum', gone)
      end
    end
  end
end
"""

# KEYS: 1 global (deadline), 2 global arrivals, 3 quarantine, 4 tenant (deadline), 5 model interactive
#       (deadline), 6 model interactive arrivals, 7 model arrival counter for this second, 8 model offline
#       (deadline), 9 global offline (deadline), 10 this process's owner hash, 11 leases, 12 the call's record
#       ('' for none: written with the admission, so that admitting a call is one round trip)
# ARGV: 1 interactive cap, 2 model cap, 3 tenant cap, 4 timeout (s), 5 n, 6 priority, 7 offline cap,
#       8 owner entry (tenant, model, class), 9 this process's instance id, 10 lease (s), 11 valid until
#       (Redis time), 12 the model's token budget (0: none), 13 the record (JSON), 14 its TTL (s),
#       item ids..., hashes..., estimated tokens...
# The script admits several calls in one round trip (the calls an API process has ready at once, see
# tasks.broker.rounds): KEYS are 12 per call, ARGV[1] the number of calls, then per call the count of its
# arguments and the arguments above; it returns one verdict per call, in order. For each call it returns
# 'ok', 'quarantined:<hash>', 'tenant_full:<n>' / 'full:<n>' with the items ahead in the full set,
# 'tokens_full:<n>' with the tokens the model holds, or
# 'late' when the call reached Redis after its caller stopped waiting for the answer (a link that came back:
# admitting it then would hold capacity for a call that was already refused).
# An interactive call counts only the interactive items ahead of it (they go first in every batch); an
# offline call counts both classes at its model, and only offline items against the global caps.
_ADMIT = _PURGE + """
local function admit(KEYS, ARGV)  -- one call's keys and arguments (shadowing the script's)
if now > tonumber(ARGV[11]) then return 'late' end
local n = tonumber(ARGV[5])
local first = 15
for i = first + n, #ARGV do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 1 then return 'quarantined:' .. ARGV[i] end
end
purge(KEYS[1], KEYS[2])
purge(KEYS[4], '')
purge(KEYS[5], KEYS[6])
purge(KEYS[8], '')
purge(KEYS[9], '')
local tenant_ahead = redis.call('ZCARD', KEYS[4])
if tenant_ahead + n > tonumber(ARGV[3]) then return 'tenant_full:' .. tenant_ahead end
redis.call('INCRBY', KEYS[7], n)  -- demand within tenant caps, admitted or not: what autoscaling must cover
redis.call('EXPIRE', KEYS[7], 60)
local offline = ARGV[6] == 'offline'
local ahead = redis.call('ZCARD', KEYS[5])
if offline then ahead = ahead + redis.call('ZCARD', KEYS[8]) end
if ahead + n > tonumber(ARGV[2]) then return 'full:' .. ahead end
local offline_total = redis.call('ZCARD', KEYS[9])
if offline then
  if offline_total + n > tonumber(ARGV[7]) then return 'full:' .. offline_total end
else
  local interactive_total = redis.call('ZCARD', KEYS[1]) - offline_total
  if interactive_total + n > tonumber(ARGV[1]) then return 'full:' .. interactive_total end
end
local need = 0
for i = first + 2 * n, first + 3 * n - 1 do need = need + tonumber(ARGV[i]) end
local token_cap = tonumber(ARGV[12])
if token_cap > 0 and need > 0 then
  local held = tonumber(redis.call('GET', KEYS[5] .. ':kvsum') or '0')
    + tonumber(redis.call('GET', KEYS[8] .. ':kvsum') or '0')
  if held + need > token_cap then return 'tokens_full:' .. held end
end
local deadline = now + tonumber(ARGV[4])
local kv_set = offline and KEYS[8] or KEYS[5]
if need > 0 then redis.call('INCRBY', kv_set .. ':kvsum', need) end
redis.call('ZADD', KEYS[11], now + tonumber(ARGV[10]), ARGV[9])
for i = first, first + n - 1 do
  redis.call('ZADD', KEYS[1], deadline, ARGV[i])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
  redis.call('ZADD', KEYS[4], deadline, ARGV[i])
  redis.call('HSET', KEYS[10], ARGV[i], ARGV[8])
  if ARGV[i + 2 * n] ~= '0' then redis.call('HSET', kv_set .. ':kv', ARGV[i], ARGV[i + 2 * n]) end
  if offline then
    redis.call('ZADD', KEYS[8], deadline, ARGV[i])
    redis.call('ZADD', KEYS[9], deadline, ARGV[i])
  else
    redis.call('ZADD', KEYS[5], deadline, ARGV[i])
    redis.call('ZADD', KEYS[6], now, ARGV[i])
  end
end
if KEYS[12] ~= '' then redis.call('SET', KEYS[12], ARGV[13], 'EX', ARGV[14]) end
return 'ok'
end

local verdicts, k, a = {}, 0, 2
for c = 1, tonumber(ARGV[1]) do
  local count = tonumber(ARGV[a])
  verdicts[c] = admit({unpack(KEYS, k + 1, k + 12)}, {unpack(ARGV, a + 1, a + count)})
  k, a = k + 12, a + count + 1
end
return verdicts
"""

# Per call: KEYS the six sets of one call (the fifth: its model's deadline set), its owner hash, its record ('' for
# none), result keys...; ARGV 1 the record as finished with 200 ('' for none), the item ids of those keys, in order.
# Reads the results and releases the admission of every item that has one. With a record: when every result is
# there and none is an error, the record is written finished, to expire with the first of its results, and
# 'finished' is appended to the values.
# The script does it for several calls in one round trip (the callers an API process woke together): ARGV[1] the
# number of calls, then per call the count of its keys, the count of its arguments, and its arguments; KEYS every
# call's keys, in order. It returns the values of each call, in order.
_COLLECT = _FORGET + """
local function collect(KEYS, ARGV)  -- one call's keys and arguments (shadowing the script's)
local values = redis.call('MGET', unpack(KEYS, 9))
local all = true
for i = 1, #values do
  if values[i] then
    for k = 1, 6 do redis.call('ZREM', KEYS[k], ARGV[i + 1]) end
    redis.call('HDEL', KEYS[7], ARGV[i + 1])
    forget(KEYS[5], ARGV[i + 1])
  else
    all = false
  end
end
if KEYS[8] ~= '' and all then
  local ttl = nil
  for i = 1, #values do
    if cjson.decode(values[i]).error then return values end
    local left = redis.call('TTL', KEYS[8 + i])
    if ttl == nil or left < ttl then ttl = left end
  end
  if ttl and ttl > 0 then
    redis.call('SET', KEYS[8], ARGV[1], 'EX', ttl)
    values[#values + 1] = 'finished'
  end
end
return values
end

local out, k, a = {}, 0, 2
for c = 1, tonumber(ARGV[1]) do
  local nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  out[c] = collect({unpack(KEYS, k + 1, k + nk)}, {unpack(ARGV, a + 2, a + 1 + na)})
  k, a = k + nk, a + 2 + na
end
return out
"""

# KEYS: the six sets of one call, its owner hash; ARGV: item ids. Releases them, whatever their state.
_RELEASE = _FORGET + """
for i = 1, #ARGV do
  for k = 1, 6 do redis.call('ZREM', KEYS[k], ARGV[i]) end
  redis.call('HDEL', KEYS[7], ARGV[i])
  forget(KEYS[5], ARGV[i])
end
return #ARGV
"""

# KEYS: leases; ARGV: 1 this instance ('' for a reaper holding no lease), 2 lease (s), 3 key prefix of the sets.
# Renews this process's lease and releases everything admitted by processes whose lease lapsed. Returns how many
# items it released.
_RENEW = _NOW + _FORGET + """
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) end
local prefix = ARGV[3]
local released = 0
for _, instance in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  local owner = prefix .. ':owner:' .. instance
  local entries = redis.call('HGETALL', owner)
  for i = 1, #entries, 2 do
    local id, entry = entries[i], entries[i + 1]
    local tenant, model, class = string.match(entry, '^(.-)\t(.-)\t(.-)$')
    local m = prefix .. ':m:' .. model
    redis.call('ZREM', prefix, id)
    redis.call('ZREM', prefix .. ':arrivals', id)
    redis.call('ZREM', prefix .. ':offline', id)
    redis.call('ZREM', prefix .. ':t:' .. tenant, id)
    redis.call('ZREM', m, id)
    redis.call('ZREM', m .. ':offline', id)
    redis.call('ZREM', m .. ':arrivals', id)
    forget(class == 'offline' and m .. ':offline' or m, id)
    released = released + 1
  end
  redis.call('DEL', owner)
  redis.call('ZREM', KEYS[1], instance)
end
return released
"""

# KEYS: model (deadline), model arrivals. The oldest unanswered arrival of a model, after purging.
_OLDEST = _PURGE + """
purge(KEYS[1], KEYS[2])
local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #oldest == 0 then return false end
return oldest[2]
"""


class Verdict(StrEnum):
    OK = "ok"
    FULL = "full"
    TENANT_FULL = "tenant_full"
    QUARANTINED = "quarantined"
    LATE = "late"
    TOKENS_FULL = "tokens_full"


class Decision(NamedTuple):
    """An admission's verdict; when quarantined, the offending input's hash; when refused for room, how many
    items were ahead in the set that was full (what must drain first: the Retry-After)."""

    verdict: Verdict
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
    """One call to admit (see :meth:`Admission.try_admit` for what each field means)."""

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
    if verdict == Verdict.QUARANTINED:
        return Decision(Verdict.QUARANTINED, bad_hash=detail)
    return Decision(Verdict(verdict), ahead=int(detail or 0))


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
        self._admit = client.register_script(_ADMIT)
        self._collect = client.register_script(_COLLECT)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._oldest = client.register_script(_OLDEST)

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis, instance: str = "") -> Admission:
        """The admission sets; ``instance`` names an API process that admits (readers leave it empty)."""
        keys = Keys.from_settings(settings)
        return cls(client, keys.inflight, settings.admission_cap, keys.quarantine,
                   offline_cap=settings.offline_admission_cap, instance=instance, lease_s=settings.api_lease_s)

    def tenant_key(self, tenant: str) -> str:
        return f"{self.key}:t:{tenant}"

    def model_key(self, model: str) -> str:
        return f"{self.key}:m:{model}"

    def _sets(self, ticket: Ticket) -> list[str]:
        """The six sets an admitted item may be in (removing it from one it is not in is a no-op that keeps the
        scripts' key count fixed)."""
        model = self.model_key(ticket.model)
        offline = ticket.priority == Priority.OFFLINE
        deadline_set = model + ":offline" if offline else model
        return [self.key, self.arrivals_key, self.offline_key, self.tenant_key(ticket.tenant), deadline_set,
                model + ":arrivals"]

    def try_admit(self, item_ids: Sequence[str], hashes: Sequence[str], *, ticket: Ticket, now: float,
                  timeout_s: float, model_cap: int | None = None, tenant_cap: int | None = None,
                  valid_until: float | None = None, tokens: Sequence[int] = (), token_cap: int = 0,
                  record: tuple[str, str, int] | None = None) -> Decision:
        """Admit all items or none, each until Redis's clock passes now + ``timeout_s`` (``now``, this host's
        clock, only names the arrival-rate bucket). A call that reaches Redis after ``valid_until`` (Redis
        time: the caller has given up on the answer by then) is not admitted: LATE. ``tokens``: each item's
        estimated tokens (generation items; 0 or empty for others), admitted only while the model's admitted
        tokens stay within ``token_cap`` (0: no token budget): TOKENS_FULL. ``record``: (key, value, TTL) of the
        call's record, written only if the call is admitted."""
        call = AdmitCall(tuple(item_ids), tuple(hashes), ticket, now, timeout_s, model_cap, tenant_cap,
                         tuple(tokens), token_cap, record)
        return self.try_admit_many([call], valid_until)[0]

    def try_admit_many(self, calls: Sequence[AdmitCall], valid_until: float | None = None) -> list[Decision]:
        """:meth:`try_admit` for several calls in one round trip, one after the other in the script (a call
        admitted counts against the caps of those after it); a decision per call, in order."""
        keys: list[Any] = []
        args: list[Any] = [len(calls)]
        for call in calls:
            call_keys, call_args = self._admit_arguments(call, NEVER if valid_until is None else valid_until)
            keys += call_keys
            args += [len(call_args), *call_args]
        return [_decision(raw) for raw in self._admit(keys=keys, args=args)]

    def _admit_arguments(self, call: AdmitCall, valid_until: float) -> tuple[list[str], list[Any]]:
        """One call's KEYS and ARGV, as the admission script reads them."""
        ticket, record = call.ticket, call.record
        model = self.model_key(ticket.model)
        keys = [self.key, self.arrivals_key, self.quarantine_key, self.tenant_key(ticket.tenant), model,
                model + ":arrivals", f"{model}:rate:{int(call.now)}", model + ":offline", self.offline_key,
                self.owner_key, self.leases_key, record[0] if record else ""]
        entry = SEP.join((ticket.tenant, ticket.model, ticket.priority))
        args = [self.cap, self.cap if call.model_cap is None else call.model_cap,
                self.cap if call.tenant_cap is None else call.tenant_cap, call.timeout_s, len(call.item_ids),
                ticket.priority, self.offline_cap, entry, self.instance, self.lease_s, valid_until, call.token_cap,
                record[1] if record else "", record[2] if record else 0, *call.item_ids, *call.hashes,
                *(call.tokens or [0] * len(call.item_ids))]
        return keys, args

    def collect(self, ticket: Ticket, item_ids: Sequence[str], result_keys: Sequence[str]) -> list[bytes | None]:
        """Read these items' result keys; items that have a result stop counting against the caps."""
        return self.collect_many([CollectCall(ticket, tuple(item_ids), tuple(result_keys))])[0][0]

    def collect_many(self, calls: Sequence[CollectCall]) -> list[tuple[list[bytes | None], bool]]:
        """:meth:`collect` for several calls in one round trip, each also writing its record (key, value as
        finished) when every result is in and none is an error; per call, in order: the values, and whether the
        record was written."""
        keys: list[str] = []
        args: list[Any] = [len(calls)]
        for call in calls:
            key, value = call.record or ("", "")
            call_keys = [*self._sets(call.ticket), self.owner_key, key, *call.result_keys]
            keys += call_keys
            args += [len(call_keys), len(call.item_ids) + 1, value, *call.item_ids]
        out = []
        for call, values in zip(calls, self._collect(keys=keys, args=args)):
            n = len(call.item_ids)
            out.append((list(values[:n]), len(values) > n))
        return out

    def release(self, ticket: Ticket, item_ids: Sequence[str]) -> None:
        if item_ids:
            self._release(keys=[*self._sets(ticket), self.owner_key], args=list(item_ids))

    def tokens_held(self, model: str) -> int:
        """Estimated tokens (prompt + max_tokens) of the model's admitted, unanswered generation items."""
        m = self.model_key(model)
        return sum(int(v or 0) for v in self.client.mget(m + ":kvsum", m + ":offline:kvsum"))

    def renew(self) -> int:
        """Renew this process's lease; release what processes whose lease lapsed had admitted (returns how many
        items). Called every ``lease_s / 3`` by each API process."""
        return int(self._renew(keys=[self.leases_key], args=[self.instance, self.lease_s, self.key]))

    def reap(self) -> int:
        """Release what processes whose lease lapsed had admitted, holding no lease (the batcher does this at
        every tick, so capacity comes back even when no API process is left to reap: the only API host cut
        off, say)."""
        return int(self._renew(keys=[self.leases_key], args=["", self.lease_s, self.key]))

    def in_flight(self, now: float) -> int:
        return int(self.client.zcount(self.key, now, "+inf"))

    def tenant_in_flight(self, tenant: str, now: float) -> int:
        return int(self.client.zcount(self.tenant_key(tenant), now, "+inf"))

    def oldest_arrival(self) -> float | None:
        """Arrival time (epoch) of the oldest admitted, unanswered item, if any."""
        oldest = self.client.zrange(self.arrivals_key, 0, 0, withscores=True)
        return float(oldest[0][1]) if oldest else None

    def model_load(self, models: Sequence[str], now: float) -> dict[str, "ModelLoad"]:
        """Per model: age of the oldest unanswered interactive request (offline ones are meant to wait) and the
        arrival rate (items/s, both classes) of the last seconds."""
        out: dict[str, ModelLoad] = {}
        second = int(now)
        for model in models:
            base = self.model_key(model)
            oldest = self._oldest(keys=[base, base + ":arrivals"])
            counts = self.client.mget([f"{base}:rate:{second - k}" for k in range(1, RATE_WINDOW_S + 1)])
            rate = sum(int(c or 0) for c in counts) / RATE_WINDOW_S
            out[model] = ModelLoad(oldest_age_s=max(0.0, now - float(oldest)) if oldest else 0.0, rate_per_s=rate)
        return out


@dataclass(frozen=True)
class ModelLoad:
    oldest_age_s: float
    rate_per_s: float


def model_report(admission: Admission, workers: Sequence[WorkerInfo], now: float, headroom: float
                 ) -> list[dict[str, Any]]:
    """One row per model served by a live worker (reads Redis: one script call and one MGET per model)."""
    models = sorted({w.model for w in workers})
    load = admission.model_load(models, now)
    rows = []
    for model in models:
        mine = [w for w in workers if w.model == model]
        timed = [w.batch_ms_estimate for w in mine if w.batch_ms_estimate > 0]
        rows.append({
            "model": model,
            "workers": len(mine),
            "oldest_queued_s": round(load[model].oldest_age_s, 3),
            "arrival_rate_per_s": round(load[model].rate_per_s, 2),
            "batch_ms": round(sum(timed) / len(timed), 1) if timed else None,
            "recommended_workers": recommended_workers(load[model].rate_per_s, mine, headroom),
        })
    return rows
