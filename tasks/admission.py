"""Admission at the door, shared by every API process through Redis: quarantine check and cap.

The cap is the configured one, or less when the fleet could not answer a new request within its deadline
(:func:`deadline_cap`): refusing at once beats letting the caller wait to time out.

Members of one sorted set are the ids of admitted, unanswered items, scored by their deadline; a second
sorted set holds the same ids scored by arrival time (for the age of the oldest waiting request). Admission
is one Lua call: refuse a quarantined input; forget members whose deadline has passed (so an API process
that died cannot leak capacity for longer than its callers' deadlines); admit all of a call's items only if
they fit under the cap.
"""
from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import redis

from tasks.fleet import WorkerInfo

# KEYS: inflight (by deadline), arrivals (by arrival), quarantine set
# ARGV: now, cap, deadline, n_items, item ids..., input hashes...
_ADMIT = """
local n = tonumber(ARGV[4])
for i = 5 + n, #ARGV do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 1 then return 'quarantined:' .. ARGV[i] end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  for i = 1, #expired, 1000 do
    redis.call('ZREM', KEYS[2], unpack(expired, i, math.min(i + 999, #expired)))
  end
end
if redis.call('ZCARD', KEYS[1]) + n > tonumber(ARGV[2]) then return 'full' end
for i = 5, 4 + n do
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i])
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
end
return 'ok'
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


# KEYS: inflight, arrivals, result keys...; ARGV: the item ids of those keys, in order.
# Reads the results and releases the admission of every item that has one, in one round trip.
_COLLECT = """
local values = redis.call('MGET', unpack(KEYS, 3))
for i = 1, #values do
  if values[i] then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
  end
end
return values
"""


class Verdict(StrEnum):
    OK = "ok"
    FULL = "full"
    QUARANTINED = "quarantined"


class Admission:
    def __init__(self, client: redis.Redis, key: str, cap: int, quarantine_key: str) -> None:
        self.client = client
        self.key = key
        self.arrivals_key = key + ":arrivals"
        self.quarantine_key = quarantine_key
        self.cap = cap
        self._admit = client.register_script(_ADMIT)
        self._collect = client.register_script(_COLLECT)

    def try_admit(self, item_ids: Sequence[str], hashes: Sequence[str], *, now: float, deadline: float,
                  cap: int | None = None) -> tuple[Verdict, str | None]:
        """Admit all items or none, under ``cap`` (default: the configured one). Returns the verdict and,
        when quarantined, the offending input hash."""
        raw = self._admit(keys=[self.key, self.arrivals_key, self.quarantine_key],
                          args=[now, self.cap if cap is None else cap, deadline, len(item_ids), *item_ids, *hashes])
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        if text.startswith("quarantined:"):
            return Verdict.QUARANTINED, text.split(":", 1)[1]
        return Verdict(text), None

    def collect(self, item_ids: Sequence[str], result_keys: Sequence[str]) -> list[bytes | None]:
        """Read these items' result keys; items that have a result stop counting against the cap."""
        return list(self._collect(keys=[self.key, self.arrivals_key, *result_keys], args=list(item_ids)))

    def release(self, item_ids: Sequence[str]) -> None:
        if item_ids:
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(self.key, *item_ids)
            pipe.zrem(self.arrivals_key, *item_ids)
            pipe.execute()

    def in_flight(self, now: float) -> int:
        return int(self.client.zcount(self.key, now, "+inf"))

    def oldest_arrival(self) -> float | None:
        """Arrival time (epoch) of the oldest admitted, unanswered item, if any."""
        oldest = self.client.zrange(self.arrivals_key, 0, 0, withscores=True)
        return float(oldest[0][1]) if oldest else None
