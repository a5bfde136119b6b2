"""Which prompt starts a worker's KV cache holds, in the batchers' names for them (pure, torch-free).

The batcher names a prompt start by keys of its input's leading text chunks (:mod:`tasks.policy.prefixes`); a
worker's cache knows pages (blocks) of tokens. A worker maps one to the other when it admits a prompt: the
pages that cover each key's text, characters and tokens in proportion and one page short for safety. Its
heartbeat then lists the keys whose pages are all still cached. sim-lm and hf-causal share this.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence

from tasks.policy.prefixes import CHUNK_CHARS

CHAINS_KEPT = 1024  # prompts whose prefix keys a cache remembers, to say which are held (most recent kept)

# a remembered prompt: its prefix keys, its whole pages' keys (chained hashes, from the start), and for each
# prefix key the number of pages that cover its text
Chain = tuple[tuple[str, ...], list[Hashable], list[int]]


class Chains:
    """The prompts admitted lately, by their last prefix key, most recent last (at most :data:`CHAINS_KEPT`)."""

    def __init__(self) -> None:
        self.chains: OrderedDict[str, Chain] = OrderedDict()

    def remember(self, prefix: Sequence[str], pages: Sequence[Hashable], prompt_tokens: int, input_chars: int,
                 page_size: int) -> None:
        """Note a prompt of ``prompt_tokens`` tokens from ``input_chars`` characters of input: its ``prefix``
        keys, and its whole ``pages``."""
        if not prefix or not pages or not input_chars:
            return
        tokens_per_char = prompt_tokens / input_chars
        per_key = [int((i + 1) * CHUNK_CHARS * tokens_per_char) // page_size - 1 for i in range(len(prefix))]
        last = prefix[-1]
        self.chains[last] = (tuple(prefix), list(pages), per_key)
        self.chains.move_to_end(last)
        while len(self.chains) > CHAINS_KEPT:
            self.chains.popitem(last=False)

    def view(self) -> list[Chain]:
        """A copy (cheap) for :func:`held_prefixes`, to run outside the engine's lock."""
        return list(self.chains.values())


def held_prefixes(chains: list[Chain], here: Container[Hashable], limit: int) -> list[str]:
    """Of the remembered chains (oldest first: keys, their pages, the pages each key needs), the keys whose
    pages are all ``here``, most recently admitted first, at most ``limit``."""
    out: dict[str, None] = {}
    for keys, pages, per_key in reversed(chains):
        if not pages or pages[0] not in here:
            continue
        for key, needed in zip(keys, per_key):  # (a chain's tail is evicted first)
            if needed < 1 or needed > len(pages) or pages[needed - 1] not in here:
                break
            out[key] = None
        if len(out) >= limit:
            break
    return list(out)[:limit]
