"""Prefix-aware routing as the batcher applies it: which buffered items wait a while for the busy worker caching
their prompt's start, and where each item of a batch goes among the workers able to take one (pure).

The keys, the index of what each worker's cache holds and the assignment itself are
:mod:`tasks.policy.prefixes`; this is the batcher's use of them, with its buffered items
(:class:`~tasks.policy.fairness.Waiting` entries) and the scheduler's choices. Items naming a LoRA adapter are
placed by :mod:`tasks.policy.adapter_routing` (the adapter's score weighed with the prefix score and load).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from tasks.policy import adapter_routing
from tasks.policy.adapter_routing import NONE, AdapterIndex
from tasks.policy.fairness import FairBuffer, Waiting
from tasks.policy.prefixes import Option, PrefixIndex, assign, held_share, prefix_keys
from tasks.policy.scheduler import Choice
from tasks.policy.scheduler_output import Entry
from tasks.schema import Batch, BatchItem, WorkerInfo


class PrefixRouter:
    def __init__(self, enabled: bool = True, wait_s: float = 1.0, adapters: bool = True,
                 wallclock: Callable[[], float] = time.time) -> None:
        self.index = PrefixIndex()  # which prompt starts each worker's cache holds
        self.enabled = enabled  # false: the scheduler's choice alone
        self.wait_s = wait_s  # how long an item may wait for the busy worker caching its start (0: never)
        self.adapters = AdapterIndex(wallclock)  # which LoRA adapters each worker holds
        self.adapter_routing = adapters  # false: adapter-blind (items of adapters go as any other)

    def report(self, workers: list[WorkerInfo]) -> None:
        """Bring what the workers' heartbeats say their caches and adapters hold into the indexes."""
        for w in workers if self.enabled else ():
            if w.prefix_caching:  # it keeps a prefix cache: route by it
                self.index.report(w.id, w.prefixes, w.heartbeat_at)
        for w in workers if self.adapter_routing else ():
            self.adapters.report(w)

    def sent(self, worker_id: str, batch: Batch, at: float) -> None:
        """``batch`` went to ``worker_id``: its prompt starts count as cached there until its reports say, and
        its adapters as resident."""
        if self.index.knows(worker_id):
            self.index.sent(worker_id, [item_keys(i) for i in batch.items], at)
        if self.adapter_routing and self.adapters.serves(worker_id):
            self.adapters.sent(worker_id, sorted({i.params.adapter for i in batch.items if i.params.adapter}))

    def forget(self, worker_id: str) -> None:
        self.index.forget(worker_id)
        self.adapters.forget(worker_id)

    def later(self, model: str, workers: list[WorkerInfo],
              choices: list[Choice], now: float) -> Callable[[Waiting[Entry]], bool] | None:
        """Which items to leave for a later batch: those of which a worker that cannot take a batch now holds a
        longer prompt start than any worker that can, or holds (or has room for) their LoRA adapter when no worker
        that can take a batch does, while they have waited less than ``wait_s`` and their deadline is not near
        (a prefix hit saves its prefill; an adapter sent where it can only be loaded by evicting another would
        evict an adapter that other calls need next). None: nothing to wait for."""
        prefix = self._prefix_later(model, workers, choices, now)
        adapter = self._adapter_later(model, workers, choices, now)
        if prefix is None or adapter is None:
            return prefix or adapter
        return lambda w: prefix(w) or adapter(w)

    def _adapter_later(self, model: str, workers: list[WorkerInfo],
                       choices: list[Choice], now: float) -> Callable[[Waiting[Entry]], bool] | None:
        serving = [w.id for w in workers if w.model == model and self.adapters.serves(w.id)]
        if not self.adapter_routing or len(serving) < 2 or self.wait_s <= 0:
            return None
        able = {c.worker.id for c in choices if c.worker is not None}
        busy = [h for h in serving if h not in able]
        if not busy:
            return None
        able_serving = [h for h in serving if h in able]
        wait, index = self.wait_s, self.adapters

        def later(w: Waiting[Entry]) -> bool:
            adapter = w.item.item.params.adapter
            if not adapter or now - w.arrived >= wait or w.deadline - now < 2 * wait:
                return False
            if any(index.score(h, adapter) > NONE for h in able_serving):
                return False
            return any(index.score(h, adapter) > NONE for h in busy)

        return later

    def _prefix_later(self, model: str, workers: list[WorkerInfo],
                      choices: list[Choice], now: float) -> Callable[[Waiting[Entry]], bool] | None:
        homes = [w.id for w in workers if w.model == model and self.index.knows(w.id)]
        if not self.enabled or len(homes) < 2 or self.wait_s <= 0:
            return None
        able = {c.worker.id for c in choices if c.worker is not None}
        able_homes = [h for h in homes if h in able]
        wait = self.wait_s

        def later(w: Waiting[Entry]) -> bool:
            if now - w.arrived >= wait or w.deadline - now < 2 * wait:
                return False
            keys = item_keys(w.item.item)
            home, match = self.index.home(keys, homes)
            return home is not None and home not in able and match > self.index.home(keys, able_homes)[1]

        return later

    def soonest_due(self, buffer: FairBuffer[Entry], now: float) -> float:
        """Seconds until the first item left for its worker stops waiting for it (it has waited ``wait_s``, or
        its deadline is near: :meth:`later`)."""
        wait = self.wait_s
        return max(0.0, min((min(w.arrived + wait, w.deadline - 2 * wait) - now for w in buffer), default=0.0))

    def routes(self, pending: list[Waiting[Entry]], choices: list[Choice],
               load: Callable[[WorkerInfo], float]) -> list[tuple[WorkerInfo, list[Waiting[Entry]]]]:
        """Where the items of a batch go: to the scheduler's choice, but for items whose prompt start another
        worker able to take a batch now holds in its prefix cache (:func:`tasks.policy.prefixes.assign`, weighed
        against each worker's ``load``); a group over that worker's KV room stays with the scheduler's choice."""
        first = choices[0].worker
        assert first is not None
        workers = [c.worker for c in choices if c.worker is not None]
        by_prefix = any(self.index.knows(w.id) for w in workers)
        named = [p.item.item.params.adapter or None for p in pending]
        by_adapter = self.adapter_routing and any(named) and any(self.adapters.serves(w.id) for w in workers)
        if len(choices) < 2 or not (by_prefix or by_adapter):
            return [(first, pending)]
        options = [Option(w.id, load(w)) for w in workers]
        keys = [item_keys(p.item.item) for p in pending]
        where = assign(keys, options, self.index) if by_prefix else [0] * len(pending)
        if by_adapter:
            where = adapter_routing.assign(named, options, self.adapters,
                                           lambda i, j: held_share(self.index, options[j].worker_id, keys[i]), where)
        groups: dict[int, list[Waiting[Entry]]] = {}
        for p, i in zip(pending, where):
            groups.setdefault(i, []).append(p)
        routes, stay = [], groups.pop(0, [])
        for i, items in groups.items():
            room = choices[i].kv_room
            if room is not None and sum(p.cost for p in items) > room:
                stay += items
            else:
                routes.append((workers[i], items))
        return [(first, stay), *routes] if stay else routes


def item_keys(item: BatchItem) -> tuple[str, ...]:
    """The prefix keys of an item's input, under its call's ``prompt_cache_key`` if it gave one."""
    return prefix_keys(item.input, cache_key=item.params.prompt_cache_key)
