"""Prompt blocks cached by the continuous engine, kept apart per LoRA adapter.

Transformers' block sharing names a complete KV block by a hash of its tokens chained to its parent's. Keys and
values depend on the adapter (its k and v projections, and every layer after the first sees its deltas), so a row of
one adapter must never take blocks another adapter or the base model wrote. :class:`AdapterBlocks` wraps the two
calls where the cache hashes a request's tokens (``search_prefix_match`` on admission, ``mark_complete_blocks``
after each forward pass) and, for a row of an adapter, hashes its tokens salted by that adapter: each token id ``t``
becomes ``-(1 + t + vocab * salt)``, negative so that it never equals a real token, the salt distinct per loaded
adapter (a reloaded adapter gets a new one, so blocks of its old weights are never matched). Rows of one adapter
still share their prompt blocks; base rows are hashed as before. Only hashes change: the tokens the model reads
are the request's own.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from transformers.generation.continuous_batching.requests import RequestStatus

INT32 = 2**31


class AdapterBlocks:
    def __init__(self, manager: Any, vocab: int, salt_of: Callable[[str], int | None]) -> None:
        self.manager = manager
        self.vocab = vocab
        self.salt_of = salt_of  # request id -> its adapter's salt (None: a base row)
        self.salts = max(1, INT32 // max(1, vocab) - 2)  # salts that keep salted ids within int32
        self._wrapped: Any = None
        self._lock = threading.Lock()

    def salted(self, ids: list[int], salt: int) -> list[int]:
        offset = 1 + self.vocab * (salt % self.salts)
        return [-(offset + t) for t in ids]

    def wrap(self) -> None:
        """Salt the cache's hashing (once it exists; again if the manager made a new cache)."""
        processor = getattr(self.manager, "batch_processor", None)
        cache = None if processor is None else processor.cache
        with self._lock:
            if cache is None or cache is self._wrapped:
                return
            self._wrapped = cache
        search, mark = cache.search_prefix_match, cache.mark_complete_blocks

        def salted_search(request_id: str, prompt_ids: list[int]) -> int:
            salt = self.salt_of(request_id)
            return int(search(request_id, prompt_ids if salt is None else self.salted(prompt_ids, salt)))

        def salted_mark(state: Any, complete_blocks: dict[str, int]) -> None:
            salt = self.salt_of(state.request_id)
            if salt is None:
                mark(state, complete_blocks)
                return
            # transformers' Cache.mark_complete_blocks, with the adapter's salted tokens
            if not cache.allow_block_sharing or not complete_blocks or state.status == RequestStatus.FINISHED:
                return
            tokens = self.salted(list(state.initial_tokens) + list(state.generated_tokens), salt)
            for name, new_complete_blocks in complete_blocks.items():
                cache.cache_allocators[name].mark_complete_blocks(state.request_id, tokens, new_complete_blocks)

        cache.search_prefix_match = salted_search
        cache.mark_complete_blocks = salted_mark
