"""What transformers' continuous-batching cache shares between prompts, counted for the worker's heartbeat.

With ``allow_block_sharing`` (5.25) the manager hashes each complete block of a prompt, chained to the blocks
before it, and keeps a finished request's hashed blocks cached until memory is needed; a later prompt that
starts with them takes them instead of prefilling them again. The manager counts none of this, so
:class:`BlockCounter` wraps the one call where a prompt is matched (``search_prefix_match``) to count the blocks
looked up and found, reads the number of hashed blocks from the cache's ledger, and names the prompt starts
still cached by the batchers' prefix keys (:mod:`gpu_worker.backends.prefix_chains`) from the prompts it was
given. The ledger is written by the manager's thread: it is only read here, one dictionary look-up at a time.
"""
from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

from gpu_worker.backends.generation import Row
from gpu_worker.backends.interface import PrefixCache
from gpu_worker.backends.prefix_chains import Chains, held_prefixes

REPORTED_KEYS = 2048  # prefix keys a heartbeat lists at most (the most recently admitted prompts' first)
COUNTED_KEPT = 4096  # request ids remembered as counted (a cancelled one may be looked up after it ended)


class _Hashed:
    """The ledger's hashed blocks as a container (``in`` is one atomic dictionary look-up)."""

    def __init__(self, hash_to_block: dict[int, int]) -> None:
        self._blocks = hash_to_block

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks


class BlockCounter:
    def __init__(self, manager: Any, page_size: int) -> None:
        self.manager = manager
        self.page_size = page_size
        self.queries = 0  # whole prompt blocks looked up when a request was first scheduled
        self.hits = 0  # of those, found cached: not prefilled
        self.chains = Chains()
        self._counted: set[str] = set()  # requests already counted (the scheduler may look one up again)
        self._matched: dict[str, int] = {}  # prompt tokens found cached, by request (its usage's cached_tokens)
        self._wrapped: Any = None  # the cache whose search_prefix_match counts
        self._lock = threading.Lock()

    def _cache(self) -> Any:
        processor = getattr(self.manager, "batch_processor", None)
        return None if processor is None else processor.cache

    def _allocator(self) -> Any:
        cache = self._cache()
        return None if cache is None else next(iter(cache.cache_allocators.values()), None)

    def _wrap(self) -> None:
        """Count the look-ups of the manager's cache (once it exists; again if the manager made a new one)."""
        cache = self._cache()
        with self._lock:  # the worker's batch threads call this at once
            if cache is None or cache is self._wrapped:
                return
            self._wrapped = cache
        search = cache.search_prefix_match

        def counted(request_id: str, prompt_ids: list[int]) -> int:
            matched = int(search(request_id, prompt_ids))
            with self._lock:
                if request_id not in self._counted:
                    if len(self._counted) >= COUNTED_KEPT:
                        self._counted.clear()
                        self._matched.clear()
                    self._counted.add(request_id)
                    self._matched[request_id] = matched
                    self.queries += (len(prompt_ids) - 1) // self.page_size
                    self.hits += matched // self.page_size
            return matched

        cache.search_prefix_match = counted

    def admitted(self, row: Row) -> None:
        """Note a prompt handed to the manager: its blocks' hashes (as the cache computes them) and prefix keys."""
        self._wrap()
        pages: list[Hashable] = []
        parent = None
        ids = row.prompt_ids
        for b in range((len(ids) - 1) // self.page_size):
            parent = compute_block_hash(parent, ids[b * self.page_size:(b + 1) * self.page_size])
            pages.append(parent)
        with self._lock:
            self.chains.remember(row.prefix, pages, len(ids), row.input_chars, self.page_size)

    def cached(self, request_id: str) -> int:
        """The prompt tokens found cached when the request was first scheduled."""
        with self._lock:
            return self._matched.get(request_id, 0)

    def finished(self, request_id: str) -> None:
        with self._lock:
            self._counted.discard(request_id)
            self._matched.pop(request_id, None)

    def figures(self) -> PrefixCache:
        self._wrap()
        cache, allocator = self._cache(), self._allocator()
        if cache is None or allocator is None:
            return PrefixCache(caching=True)
        if not cache.use_prefix_sharing:  # e.g. a model with sliding-window layers: nothing is shared
            return PrefixCache(caching=False)
        hashed = allocator.ledger.hash_to_block
        with self._lock:
            queries, hits, chains = self.queries, self.hits, self.chains.view()
        keys = held_prefixes(chains, _Hashed(hashed), REPORTED_KEYS)
        return PrefixCache(True, queries, hits, len(hashed), tuple(keys))
