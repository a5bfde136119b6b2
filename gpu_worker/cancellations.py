"""Callers that went away: API processes publish their item ids; the running generation stops for them.

One pub/sub subscription per worker, in a thread of its own; the decoding loop only looks the id up in a
set. The set forgets old ids (bounded), since a cancelled item only matters while its batch runs.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import redis

log = logging.getLogger("llmb.worker")


class Cancellations:
    def __init__(self, client: redis.Redis, channel: str, keep: int = 10_000) -> None:
        self.client = client
        self.channel = channel
        self.keep = keep
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        threading.Thread(target=self._listen, name="cancellations", daemon=True).start()

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._ids

    def add(self, item_ids: list[str]) -> None:
        with self._lock:
            for item_id in item_ids:
                self._ids[item_id] = None
            while len(self._ids) > self.keep:
                self._ids.popitem(last=False)

    def _listen(self) -> None:
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if message and message["type"] == "message":
                        self.add(message["data"].decode().split(","))
            except (redis.RedisError, OSError) as exc:
                log.warning("cancellation listener lost Redis (%s); reconnecting", exc)
                time.sleep(0.5)
            finally:
                try:
                    pubsub.close()
                except Exception:
                    pass
