"""Callers that went away: API processes publish their item ids; the running generation stops for them.

One subscription per worker (:class:`tasks.state.pubsub.Subscription`); the decoding loop only looks the id up
in a set. The set forgets old ids (bounded), since a cancelled item only matters while its batch runs.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import redis

from tasks.state.pubsub import Subscription


class Cancellations:
    def __init__(self, client: redis.Redis, channel: str, keep: int = 10_000) -> None:
        self.keep = keep
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        Subscription(client, channel, lambda raw: self.add(raw.decode().split(",")), name="cancellations").start()

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._ids

    def add(self, item_ids: list[str]) -> None:
        with self._lock:
            for item_id in item_ids:
                self._ids[item_id] = None
            while len(self._ids) > self.keep:
                self._ids.popitem(last=False)
