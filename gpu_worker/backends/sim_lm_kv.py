"""sim-lm's paged KV cache: pages held by sequences, the shared prompt pages counted once, and (as vLLM's automatic
prefix caching keeps them) the prompt pages nobody holds any more, cached by key until room is needed."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpu_worker.backends.prefix_chains import Chain, Chains, held_prefixes

if TYPE_CHECKING:
    from gpu_worker.backends.sim_lm_engine import Seq


def page_keys(prompt_ids: Sequence[int], page_size: int) -> list[int]:
    """A key per whole page of the prompt, chained, so two prompts share page i only if they share pages 0..i."""
    keys, last = [], 0
    for start in range(0, len(prompt_ids) - page_size + 1, page_size):
        last = hash((last, tuple(prompt_ids[start:start + page_size])))
        keys.append(last)
    return keys


class KVCache:
    """Pages held by sequences: shared prompt pages once however many hold them, plus their own pages; and, as
    vLLM's automatic prefix caching keeps them, the shared prompt pages nobody holds any more, by key, evicted
    least recently used when room is needed. A cached page counts as free (it is given up on demand), and a
    later prompt starting with it is not prefilled there again."""

    def __init__(self, tokens: int, page_size: int, sharing: bool = True) -> None:
        if page_size < 1 or tokens < page_size:
            raise ValueError(f"a KV cache of {tokens} tokens cannot hold a page of {page_size}")
        self.page_size = page_size
        self.total = tokens // page_size
        self.sharing = sharing
        self.holders: dict[int, int] = {}  # shared page key -> sequences holding it
        self.private = 0
        self.cached: OrderedDict[int, None] = OrderedDict()  # pages no sequence holds, least recently used first
        self.queried = 0  # whole prompt pages looked up on admission (counting from the start)
        self.hits = 0  # of those, found here: not prefilled
        self.chains = Chains()  # prompts admitted lately, and the pages that cover each of their prefix keys

    @property
    def used(self) -> int:
        return len(self.holders) + self.private

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def tokens(self) -> int:
        return self.total * self.page_size

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def shared_pages(self, seq: Seq, tokens: int) -> int:
        """How many of its whole prompt pages ``seq`` holds as shared pages when it holds ``tokens`` tokens."""
        return min(len(seq.page_keys), self.pages(tokens)) if self.sharing else 0

    def resident(self, seq: Seq) -> int:
        """Whole prompt pages of ``seq``, from the start, that are here already (held by other sequences, or
        cached from earlier ones): no prefill for them."""
        n = 0
        for key in seq.page_keys[:self.shared_pages(seq, seq.length)]:
            if key not in self.holders and key not in self.cached:
                break
            n += 1
        return n

    def lookup(self, seq: Seq) -> int:
        """:meth:`resident`, counted as a look-up of the prefix cache (on admission)."""
        found = self.resident(seq)
        self.queried += self.shared_pages(seq, seq.length)
        self.hits += found
        return found

    def cost(self, seq: Seq, tokens: int) -> int:
        """New pages ``seq`` needs to hold ``tokens`` tokens."""
        shared = self.shared_pages(seq, tokens)
        new_shared = sum(1 for k in seq.page_keys[len(seq.shared):shared] if k not in self.holders)
        return new_shared + self.pages(tokens) - shared - seq.private

    def hold(self, seq: Seq, tokens: int) -> None:
        """Let ``seq`` hold ``tokens`` tokens (the caller checked the cost fits): cached pages it starts with are
        taken back, and the least recently used others evicted for the room it takes."""
        shared = self.shared_pages(seq, tokens)
        for key in seq.page_keys[len(seq.shared):shared]:
            self.cached.pop(key, None)
            self.holders[key] = self.holders.get(key, 0) + 1
            seq.shared.append(key)
        private = self.pages(tokens) - shared
        self.private += private - seq.private
        seq.private = private
        while self.cached and self.used + len(self.cached) > self.total:
            self.cached.popitem(last=False)

    def release(self, seq: Seq) -> None:
        for key in reversed(seq.shared):  # its tail the least recently used: evicted before its head, as vLLM does
            self.holders[key] -= 1
            if not self.holders[key]:
                del self.holders[key]
                self.cached[key] = None  # the most recently used of the cached pages
        self.private -= seq.private
        seq.shared, seq.private = [], 0

    def blocks(self) -> int:
        """Prompt pages here now, held or cached (what a later prompt may find)."""
        return len(self.holders) + len(self.cached)

    def remember(self, seq: Seq) -> None:
        """Note which pages cover each of ``seq``'s prefix keys, so :meth:`prefixes` can say which are held."""
        if self.sharing:
            self.chains.remember(seq.prefix, seq.page_keys, seq.prompt_len, seq.input_chars, self.page_size)

    def prefix_view(self) -> tuple[list[Chain], frozenset[int]]:
        """What :func:`held_prefixes` needs, copied (cheap) so that it can run outside the engine's lock."""
        return self.chains.view(), frozenset(self.holders) | frozenset(self.cached)

    def prefixes(self, limit: int) -> list[str]:
        """The prefix keys whose pages are all here now (held or cached), most recently admitted first."""
        return held_prefixes(*self.prefix_view(), limit)
