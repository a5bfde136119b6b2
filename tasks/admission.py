"""Global admission cap, shared by every API process through one Redis sorted set.

Members are the ids of admitted, unanswered items, scored by their deadline. Admission is one Lua call:
forget members whose deadline has passed (so an API process that died cannot leak capacity for longer than
its callers' deadlines), then admit all of a call's items only if they fit under the cap.
"""
from __future__ import annotations

from collections.abc import Sequence

import redis

_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local n = #ARGV - 3
if redis.call('ZCARD', KEYS[1]) + n > tonumber(ARGV[2]) then
  return 0
end
for i = 4, #ARGV do
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i])
end
return 1
"""


class Admission:
    def __init__(self, client: redis.Redis, key: str, cap: int) -> None:
        self.client = client
        self.key = key
        self.cap = cap
        self._admit = client.register_script(_ADMIT)

    def try_admit(self, item_ids: Sequence[str], *, now: float, deadline: float) -> bool:
        """Admit all items (True) or none (False). ``now`` and ``deadline`` are epoch seconds."""
        return bool(self._admit(keys=[self.key], args=[now, self.cap, deadline, *item_ids]))

    def release(self, item_ids: Sequence[str]) -> None:
        if item_ids:
            self.client.zrem(self.key, *item_ids)

    def in_flight(self, now: float) -> int:
        return int(self.client.zcount(self.key, now, "+inf"))
