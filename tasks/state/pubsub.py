"""One Redis pub/sub subscription that survives Redis going away: the one listener loop of the system.

Used for result wake-ups in the API processes and for cancellations in the GPU workers. Messages published
while the connection was down are lost, so the owner gets ``on_connect`` after each (re)subscription to
re-read whatever the messages would have told it.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)
RECONNECT_S = 0.5


class Subscription:
    """Calls ``on_message(data)`` for every message on ``channel``, from a daemon thread (a greenlet under
    gunicorn's gevent worker). Started lazily by :meth:`start`, so it runs in the process that forked last."""

    def __init__(self, client: redis.Redis, channel: str, on_message: Callable[[bytes], None], *,
                 on_connect: Callable[[], None] | None = None, name: str = "subscription") -> None:
        self.client = client
        self.channel = channel
        self.on_message = on_message
        self.on_connect = on_connect
        self.name = name
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._started:
            return
        with self._lock:
            if not self._started:
                threading.Thread(target=self._listen, name=self.name, daemon=True).start()
                self._started = True

    def _listen(self) -> None:
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                if self.on_connect is not None:
                    self.on_connect()
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if message and message["type"] == "message":
                        self.on_message(message["data"])
            except (redis.RedisError, OSError) as exc:
                log.warning("%s lost Redis (%s); reconnecting", self.name, exc)
                time.sleep(RECONNECT_S)
            finally:
                with contextlib.suppress(Exception):  # closing a broken connection may raise; nothing left to clean
                    pubsub.close()
