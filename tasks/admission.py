"""Admission at the door, shared by every API process through Redis: quarantine check and three caps.

An item is admitted only if it fits under all of:

- the global cap (``LLMB_ADMISSION_CAP``): what the whole system holds;
- its model's cap: what that model's workers can answer within the caller's deadline (:func:`deadline_cap`),
  so overload is refused at once rather than left to time out;
- its tenant's in-flight cap, so one tenant cannot take the whole system (the others are unaffected).

Each cap is a sorted set of the ids of admitted, unanswered items scored by their deadline; the model also has
a set scored by arrival time, for the age of its oldest waiting request (the autoscaling signal), and a
per-second arrival counter, for its arrival rate (refused calls count: they are demand the fleet missed).
Admission is one Lua call: refuse a quarantined input; forget members whose deadline has passed (so an API
process that died cannot leak capacity for longer than its callers' deadlines); admit all of a call's items
only if they fit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import redis

from tasks.fleet import WorkerInfo

RATE_WINDOW_S = 10  # the arrival rate is the mean over this many whole seconds

# Forget expired members of a deadline set and of its arrival set. KEYS: set by deadline, set by arrival or ''.
_PURGE = """
local function purge(by_deadline, by_arrival, now)
  local expired = redis.call('ZRANGEBYSCORE', by_deadline, '-inf', now)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', by_deadline, '-inf', now)
    if by_arrival ~= '' then
      for i = 1, #expired, 1000 do
        redis.call('ZREM', by_arrival, unpack(expired, i, math.min(i + 999, #expired)))
      end
    end
  end
end
"""

# KEYS: global (deadline), global arrivals, quarantine, tenant (deadline), model interactive (deadline),
#       model interactive arrivals, model arrival counter for this second, model offline (deadline)
# ARGV: now, global cap, model cap, tenant cap, deadline, n, priority, item ids..., input hashes...
# An interactive call counts only the interactive items ahead of it (they go first in every batch); an
# offline call counts both classes.
_ADMIT = _PURGE + """
local n = tonumber(ARGV[6])
for i = 8 + n, #ARGV do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 1 then return 'quarantined:' .. ARGV[i] end
end
purge(KEYS[1], KEYS[2], ARGV[1])
purge(KEYS[4], '', ARGV[1])
purge(KEYS[5], KEYS[6], ARGV[1])
purge(KEYS[8], '', ARGV[1])
if redis.call('ZCARD', KEYS[4]) + n > tonumber(ARGV[4]) then return 'tenant_full' end
redis.call('INCRBY', KEYS[7], n)  -- demand on the fleet, admitted or not: what autoscaling must cover
redis.call('EXPIRE', KEYS[7], 60)
local offline = ARGV[7] == 'offline'
local ahead = redis.call('ZCARD', KEYS[5])
if offline then ahead = ahead + redis.call('ZCARD', KEYS[8]) end
if ahead + n > tonumber(ARGV[3]) then return 'full' end
if redis.call('ZCARD', KEYS[1]) + n > tonumber(ARGV[2]) then return 'full' end
for i = 8, 7 + n do
  redis.call('ZADD', KEYS[1], ARGV[5], ARGV[i])
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
  redis.call('ZADD', KEYS[4], ARGV[5], ARGV[i])
  if offline then
    redis.call('ZADD', KEYS[8], ARGV[5], ARGV[i])
  else
    redis.call('ZADD', KEYS[5], ARGV[5], ARGV[i])
    redis.call('ZADD', KEYS[6], ARGV[1], ARGV[i])
  end
end
return 'ok'
"""

# KEYS: the five sets of one call, result keys...; ARGV: the item ids of those keys, in order.
# Reads the results and releases the admission of every item that has one, in one round trip.
_COLLECT = """
local values = redis.call('MGET', unpack(KEYS, 6))
for i = 1, #values do
  if values[i] then
    for k = 1, 5 do redis.call('ZREM', KEYS[k], ARGV[i]) end
  end
end
return values
"""

# KEYS: model (deadline), model arrivals; ARGV: now. The oldest unanswered arrival of a model, after purging.
_OLDEST = _PURGE + """
purge(KEYS[1], KEYS[2], ARGV[1])
local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #oldest == 0 then return false end
return oldest[2]
"""


def deadline_cap(workers: Sequence[WorkerInfo], timeout_s: float, configured: int) -> int:
    """How many items may be in flight for a new request to still be answered within ``timeout_s``.

    The fleet's throughput (batch size over measured batch time, summed over live workers) times the time
    the caller is willing to wait; never less than one full batch per worker, never more than the
    configured cap. A request beyond it would only wait to time out, so it is refused at once instead.
    """
    timed = [w for w in workers if w.batch_ms_estimate > 0]
    if not timed:
        return configured
    throughput = sum(w.max_batch / (w.batch_ms_estimate / 1000) for w in timed)
    floor = sum(w.max_batch for w in workers)
    return min(configured, max(floor, int(throughput * timeout_s)))


class Verdict(StrEnum):
    OK = "ok"
    FULL = "full"
    TENANT_FULL = "tenant_full"
    QUARANTINED = "quarantined"


@dataclass(frozen=True)
class Ticket:
    """Where a call's items were admitted: the sets to release them from."""

    tenant: str
    model: str
    priority: str = "interactive"


class Admission:
    def __init__(self, client: redis.Redis, key: str, cap: int, quarantine_key: str) -> None:
        self.client = client
        self.key = key
        self.arrivals_key = key + ":arrivals"
        self.quarantine_key = quarantine_key
        self.cap = cap
        self._admit = client.register_script(_ADMIT)
        self._collect = client.register_script(_COLLECT)
        self._oldest = client.register_script(_OLDEST)

    def tenant_key(self, tenant: str) -> str:
        return f"{self.key}:t:{tenant}"

    def model_key(self, model: str) -> str:
        return f"{self.key}:m:{model}"

    def _sets(self, ticket: Ticket) -> list[str]:
        """The five sets an admitted item is in (for an offline one, its arrival set is not one of them; removing
        from it is a no-op that keeps the scripts' key count fixed)."""
        model = self.model_key(ticket.model)
        deadline_set = model + ":offline" if ticket.priority == "offline" else model
        return [self.key, self.arrivals_key, self.tenant_key(ticket.tenant), deadline_set, model + ":arrivals"]

    def try_admit(self, item_ids: Sequence[str], hashes: Sequence[str], *, ticket: Ticket, now: float,
                  deadline: float, model_cap: int | None = None, tenant_cap: int | None = None
                  ) -> tuple[Verdict, str | None]:
        """Admit all items or none. Returns the verdict and, when quarantined, the offending input hash."""
        model = self.model_key(ticket.model)
        keys = [self.key, self.arrivals_key, self.quarantine_key, self.tenant_key(ticket.tenant), model,
                model + ":arrivals", f"{model}:rate:{int(now)}", model + ":offline"]
        raw = self._admit(keys=keys, args=[now, self.cap, self.cap if model_cap is None else model_cap,
                                           self.cap if tenant_cap is None else tenant_cap, deadline, len(item_ids),
                                           ticket.priority, *item_ids, *hashes])
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        if text.startswith("quarantined:"):
            return Verdict.QUARANTINED, text.split(":", 1)[1]
        return Verdict(text), None

    def collect(self, ticket: Ticket, item_ids: Sequence[str], result_keys: Sequence[str]) -> list[bytes | None]:
        """Read these items' result keys; items that have a result stop counting against the caps."""
        return list(self._collect(keys=[*self._sets(ticket), *result_keys], args=list(item_ids)))

    def release(self, ticket: Ticket, item_ids: Sequence[str]) -> None:
        if item_ids:
            pipe = self.client.pipeline(transaction=False)
            for key in self._sets(ticket):
                pipe.zrem(key, *item_ids)
            pipe.execute()

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
            oldest = self._oldest(keys=[base, base + ":arrivals"], args=[now])
            counts = self.client.mget([f"{base}:rate:{second - k}" for k in range(1, RATE_WINDOW_S + 1)])
            rate = sum(int(c or 0) for c in counts) / RATE_WINDOW_S
            out[model] = ModelLoad(oldest_age_s=max(0.0, now - float(oldest)) if oldest else 0.0, rate_per_s=rate)
        return out


@dataclass(frozen=True)
class ModelLoad:
    oldest_age_s: float
    rate_per_s: float
