"""The result path: workers write outputs to Redis keys; API processes wait for them.

The key per item is the source of truth. The pub/sub message that follows is only a wake-up: a waiter that
misses it still finds its result by re-reading its keys every ``recheck_s`` and once more at its deadline.
Each API process holds one pub/sub connection for all of its waiters (:class:`ResultListener`), so Redis
connections do not grow with the number of waiting requests.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis

from tasks.config import Settings
from tasks.schema import BatchItem, ItemResult
from tasks.state.claims import DONE
from tasks.state.journal import Journal
from tasks.state.keys import Keys
from tasks.state.pubsub import Subscription

log = logging.getLogger(__name__)
Read = Callable[[Sequence[str]], list[bytes | None]]  # item ids -> their result keys' values, in order
REDIS_GRACE_S = 5.0  # a waiter rides out a Redis outage this long before its caller gets 503
REDIS_RETRY_S = 0.25  # how often it tries Redis again meanwhile


class ResultWriter:
    """Used by GPU workers: one Redis round trip per batch for all outputs and wake-ups."""

    def __init__(self, client: redis.Redis, key: Callable[[str], str], ttl_s: int,
                 counter_key: str | None = None, batch_counter_key: str | None = None,
                 journal: Journal | None = None) -> None:
        self.client = client
        self.key = key
        self.ttl_s = ttl_s
        self.counter_key = counter_key  # items answered with an output
        self.batch_counter_key = batch_counter_key  # batches run
        self.journal = journal  # where streamed text is kept for resuming (None: not kept)

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis, *, count: bool = False) -> ResultWriter:
        """``count``: also count items and batches answered (the GPU workers' writer; recovery's does not)."""
        keys = Keys.from_settings(settings)
        ttl_s = settings.stores.result_ttl_s
        return cls(client, keys.result, ttl_s, keys.stat("items_done") if count else None,
                   keys.stat("batches_done") if count else None, Journal(client, keys, ttl_s))

    def write(self, results: Iterable[tuple[BatchItem, ItemResult]], done_key: str | None = None,
              extra: Callable[[Any], None] | None = None) -> None:
        """Write every result, wake every waiting API process, and (for a batch run) mark its claim done;
        ``extra`` may add commands (metrics) to the same pipeline."""
        pipe = self.client.pipeline(transaction=False)
        by_channel: dict[str, list[str]] = defaultdict(list)
        count = 0
        for item, result in results:
            pipe.set(self.key(item.id), json.dumps(result.to_dict()), ex=self.ttl_s)
            by_channel[item.reply_to].append(item.id)
            count += 1
        if not count and done_key is None and extra is None:
            return
        if self.counter_key and count:
            pipe.incrby(self.counter_key, count)
        if done_key is not None:
            pipe.set(done_key, DONE, ex=self.ttl_s)
            if self.batch_counter_key:
                pipe.incr(self.batch_counter_key)
        if extra is not None:
            extra(pipe)
        for channel, ids in by_channel.items():
            pipe.publish(channel, ",".join(ids))
        pipe.execute()

    def mark_done(self, done_key: str) -> None:
        self.client.set(done_key, DONE, ex=self.ttl_s)

    def answered(self, item_ids: Sequence[str]) -> set[str]:
        """The items among these that already have a result (one round trip)."""
        pipe = self.client.pipeline(transaction=False)
        for item_id in item_ids:
            pipe.exists(self.key(item_id))
        return {item_id for item_id, found in zip(item_ids, pipe.execute()) if found}


    def stream(self, deltas: Iterable[tuple[BatchItem, int, str]]) -> None:
        """Stream text to waiting callers: (item, offset in its text, text), one PUBLISH per reply channel, each
        piece kept in the item's journal too (:mod:`tasks.state.journal`), all in one round trip."""
        by_channel: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
        pipe = self.client.pipeline(transaction=False)
        for item, offset, text in deltas:
            by_channel[item.reply_to].append((item.id, text, offset))
            if self.journal is not None:
                self.journal.append(pipe, item.id, offset, text)
        if by_channel:
            for channel, pairs in by_channel.items():
                pipe.publish(channel, DELTAS + json.dumps(pairs))
            pipe.execute()


DELTAS = "D"  # first character of a pub/sub message carrying streamed text rather than finished item ids


class _Waiter:
    __slots__ = ("deltas", "event", "ready")

    def __init__(self) -> None:
        self.event = threading.Event()
        # streamed (item id, text, offset in the item's text: -1 unknown) not yet handed to the caller
        self.deltas: deque[tuple[str, str, int]] = deque()
        self.ready = False  # a result was announced: read the keys


class ResultListener:
    """One per API process: a single subscription that wakes whichever request's items just finished.

    Under gunicorn's gevent worker, ``threading`` is monkey-patched, so the listener is a greenlet and each
    waiter's event is a gevent event; without gevent they are real threads and events, and it works the same.
    """

    def __init__(self, client: redis.Redis, channel: str, key: Callable[[str], str], recheck_s: float,
                 read: Read | None = None) -> None:
        self.client = client
        self.channel = channel
        self.key = key
        self.recheck_s = recheck_s
        # How to read result keys: plain MGET by default; the gateway reads and releases admission together.
        self.read: Read = read or self._mget
        # Waiters by item id: usually one, the call's own; an idempotent retry waiting in the same process for the
        # first call's items adds its own.
        self._waiters: dict[str, list[_Waiter]] = {}
        # After each (re)subscription, wake every waiter: anything published while away is in the keys.
        self._subscription = Subscription(client, channel, self._on_message,
                                          on_connect=lambda: self._wake(list(self._waiters)), name="result listener")

    def start(self) -> None:
        """Start the listener once, lazily, in the process that will wait (after gunicorn forks)."""
        self._subscription.start()

    def expect(self, item_ids: Sequence[str]) -> _Waiter:
        """Listen for these items from now: called before their request is published, so that no wake-up or
        streamed text the workers publish for them can come before anyone listens. Hand the waiter to
        :meth:`wait` or :meth:`stream` (or to :meth:`forget` if the request was not published)."""
        self.start()
        waiter = _Waiter()
        for item_id in item_ids:
            self._waiters.setdefault(item_id, []).append(waiter)
        return waiter

    def forget(self, item_ids: Sequence[str], waiter: _Waiter) -> None:
        for item_id in item_ids:
            self._forget(item_id, waiter)

    def wait(self, item_ids: Sequence[str], deadline: float, read: Read | None = None,
             waiter: _Waiter | None = None) -> dict[str, ItemResult]:
        """Block until every item has a result or the monotonic ``deadline`` passes.

        Returns whatever results exist by then (possibly fewer than asked for: the caller decides it is a
        timeout). Never waits past the deadline. Redis going away for less than ``REDIS_GRACE_S`` costs
        nothing (workers hold their results until it is back); longer, and the RedisError is raised.
        ``waiter``: the one :meth:`expect` gave before the request was published; without it the keys are
        read once at once (a result may have come before this call listened).
        """
        read_first = waiter is None
        waiter = waiter or self.expect(item_ids)
        results: dict[str, ItemResult] = {}
        pending = list(item_ids)
        failing_since: float | None = None
        try:
            while True:
                remaining = deadline - time.monotonic()
                if read_first:
                    read_first = False
                elif remaining > 0:
                    waiter.event.wait(min(remaining, self.recheck_s if failing_since is None else REDIS_RETRY_S))
                    waiter.event.clear()
                try:
                    results.update(self.fetch(pending, read))
                    failing_since = None
                except redis.RedisError:
                    now = time.monotonic()
                    failing_since = now if failing_since is None else failing_since
                    if remaining <= 0 or now - failing_since >= REDIS_GRACE_S:
                        raise
                pending = [i for i in pending if i not in results]
                if not pending or remaining <= 0:
                    return results
        finally:
            for item_id in item_ids:
                self._forget(item_id, waiter)

    def stream(self, item_ids: Sequence[str], deadline: float, read: Read | None = None,
               waiter: _Waiter | None = None) -> Iterator[tuple[str, str, Any]]:
        """Yield ("delta", item id, (text, its offset in the item's text)) as the workers stream it and ("done",
        item id, ItemResult) as each item finishes (after the last of its text), or ("timeout", "", None) once
        the deadline passes with items
        unfinished. ``waiter``: the one :meth:`expect` gave before the request was published (so no text is
        missed). Text of an item that finished is not yielded again: its result holds it."""
        waiter = waiter or self.expect(item_ids)
        pending = list(item_ids)
        next_check = time.monotonic() + self.recheck_s
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining > 0 and not waiter.deltas and not waiter.ready:
                    waiter.event.wait(min(remaining, max(0.0, next_check - time.monotonic())))
                waiter.event.clear()
                while waiter.deltas:
                    item_id, text, offset = waiter.deltas.popleft()
                    if item_id in pending:
                        yield "delta", item_id, (text, offset)
                if waiter.ready or time.monotonic() >= next_check or remaining <= 0:
                    waiter.ready = False
                    next_check = time.monotonic() + self.recheck_s
                    found = self.fetch(pending, read)
                    if found:
                        while waiter.deltas:  # the text that came before the result, first
                            item_id, text, offset = waiter.deltas.popleft()
                            if item_id in pending:
                                yield "delta", item_id, (text, offset)
                        for item_id in [i for i in pending if i in found]:
                            pending.remove(item_id)
                            self._forget(item_id, waiter)
                            yield "done", item_id, found[item_id]
                    if pending and remaining <= 0:
                        yield "timeout", "", None
                        return
        finally:
            self.forget(pending, waiter)

    def _forget(self, item_id: str, waiter: _Waiter) -> None:
        waiters = self._waiters.get(item_id, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            self._waiters.pop(item_id, None)

    def _mget(self, item_ids: Sequence[str]) -> list[bytes | None]:
        return list(self.client.mget([self.key(i) for i in item_ids]))  # type: ignore[arg-type]

    def fetch(self, item_ids: Sequence[str], read: Read | None = None) -> dict[str, ItemResult]:
        """Results of these items that exist; ``read`` overrides how keys are read (one call's own reader)."""
        if not item_ids:
            return {}
        raw = (read or self.read)(item_ids)
        return {i: ItemResult.from_dict(json.loads(r)) for i, r in zip(item_ids, raw) if r is not None}

    def _wake(self, item_ids: Iterable[str]) -> None:
        for item_id in item_ids:
            for waiter in self._waiters.get(item_id, ()):
                waiter.ready = True
                waiter.event.set()

    def _deliver(self, pieces: list[list[Any]]) -> None:
        for piece in pieces:  # [item id, text, offset] ([item id, text] from a worker before offsets)
            item_id, text, offset = str(piece[0]), str(piece[1]), int(piece[2]) if len(piece) > 2 else -1
            for waiter in self._waiters.get(item_id, ()):
                waiter.deltas.append((item_id, text, offset))
                waiter.event.set()

    def _on_message(self, raw: bytes) -> None:
        data = raw.decode()
        if data.startswith(DELTAS):
            self._deliver(json.loads(data[1:]))
        else:
            self._wake(data.split(","))
