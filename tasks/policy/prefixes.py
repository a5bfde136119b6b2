"""Prefix-aware routing: send an item to the worker whose KV cache already holds the start of its prompt (pure).

Chat traffic shares long prompt starts: a product's system prompt, a tenant's instructions, the earlier turns of
a conversation. A worker that keeps prompt pages cached after their calls end (sim-lm's prefix cache, as vLLM's
automatic prefix caching) skips the prefill of a start it holds, so where an item runs decides its time to first
token. The batcher knows nothing of tokens (no tokenizer leaves the workers), so a prompt start is named by the
text the caller sent: :func:`prefix_keys` hashes the input's leading chunks of :data:`CHUNK_CHARS` characters,
each key chained to those before it, so two inputs share key ``i`` only if they share their first ``i + 1``
chunks. A chat call's input is its messages as JSON, so a conversation's later turn shares the keys of the
earlier messages, and every call of a tenant those of its system prompt.

Where the keys are cached, the batcher learns as llm-d's precise mode does, from the workers: each heartbeat
carries the keys whose prompt pages its cache holds now (it maps each key to the pages that cover it when it
admits the prompt, and reports a key while those pages are resident). Between heartbeats, what the batcher sent
to a worker counts as cached there too (it will be once the batch runs): :class:`PrefixIndex`.

The decision, :func:`assign`, only ever chooses among the workers the scheduler found able to take a batch now
(outstanding limit, backlog, KV room: :mod:`tasks.policy.scheduler`). It weighs, as llm-d's scorers do, the share
of the item's start a worker holds against the share of its capacity it has outstanding: a worker holding the
whole start wins unless it is loaded by more than half its capacity beyond another (``PREFIX_WEIGHT`` /
``LOAD_WEIGHT``), and a match of fewer than :data:`MIN_MATCH_CHUNKS` chunks counts as none. A hot tenant's
prefix is replicated that way: while the worker holding it is full (not able to take a batch) or too far
ahead, its items go where the scheduler puts them, and that worker caches the prefix too. Which items form the
batch is decided before (fair queueing, priority, deadlines, token budget: :mod:`tasks.policy.fairness`), so
none of that changes; with one worker able to take the batch, or workers that report no prefix cache
(black-box models), nothing does.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

CHUNK_CHARS = 512  # characters of input per key (about 128 tokens of English)
MAX_CHUNKS = 64  # keys per input at most: the first 32 KB name a prompt's start
MIN_MATCH_CHUNKS = 2  # shorter shared starts are not worth moving an item for
PREFIX_WEIGHT = 1.0  # a worker holding an item's whole start ...
LOAD_WEIGHT = 2.0  # ... is worth half its capacity more load than the least loaded one
KEYS_PER_WORKER = 20_000  # the index remembers at most this many keys per worker (most recently seen kept)
SENT_KEPT_S = 5.0  # keys sent to a worker count as held there this long, whatever its reports say (not run yet)


def prefix_keys(text: str, *, cache_key: str | None = None, chunk_chars: int = CHUNK_CHARS,
                max_chunks: int = MAX_CHUNKS) -> tuple[str, ...]:
    """Chained keys of the text's whole leading chunks: key ``i`` names the first ``i + 1`` chunks. A stable
    hash (the same in every process, unlike ``hash()``), 16 hex digits.

    A ``cache_key`` (OpenAI's ``prompt_cache_key``, in the item's params) starts the chain, as OpenAI combines
    it with its prefix hash: the same start under two keys has two names, so each key's calls follow the worker
    that served that key's start, and a hot start shared by many keys (one system prompt, many users) spreads
    over the workers a key at a time instead of piling onto one. The worker names what it caches the same way
    (the item's params reach it), and calls without a key are named as before."""
    return _chained_keys(text[:chunk_chars * max_chunks], chunk_chars, cache_key or "")


# An item is asked about at each flush it waits through. Keyed on the start that is hashed (at most 32 KB), not
# on the whole input (up to the 1 MiB body limit), so the cache holds at most 32 MB.
@lru_cache(maxsize=1024)
def _chained_keys(head: str, chunk_chars: int, cache_key: str) -> tuple[str, ...]:
    keys: list[str] = []
    chained = hashlib.blake2b(digest_size=8)
    if cache_key:
        chained.update(f"prompt_cache_key\0{cache_key}\0".encode("utf-8", "surrogatepass"))
    for i in range(len(head) // chunk_chars):
        chained.update(head[i * chunk_chars:(i + 1) * chunk_chars].encode("utf-8", "surrogatepass"))
        keys.append(chained.copy().hexdigest())
    return tuple(keys)


class PrefixIndex:
    """Which prefix keys each worker holds: its last report, plus what was sent to it since."""

    def __init__(self, keys_per_worker: int = KEYS_PER_WORKER) -> None:
        self.keys_per_worker = keys_per_worker
        self._held: dict[str, OrderedDict[str, None]] = {}
        self._reported: dict[str, float] = {}  # worker -> the heartbeat time of the report in use
        self._sent: dict[str, deque[tuple[float, Sequence[str]]]] = {}  # worker -> (when, keys) sent lately

    def knows(self, worker_id: str) -> bool:
        """Whether the worker reports a prefix cache (a worker that does not is never routed to by prefix)."""
        return worker_id in self._reported

    def report(self, worker_id: str, keys: Sequence[str], at: float) -> None:
        """A worker's heartbeat (taken at ``at``, wall clock) lists the keys it holds, most recent first: they
        replace what was known, but for keys sent to it in the :data:`SENT_KEPT_S` before (it may not have run
        them yet). A report no newer than the one in use is ignored."""
        if at <= self._reported.get(worker_id, float("-inf")):
            return
        self._reported[worker_id] = at
        held: OrderedDict[str, None] = OrderedDict((k, None) for k in reversed(keys))
        sent = self._sent.get(worker_id, deque())
        while sent and sent[0][0] < at - SENT_KEPT_S:
            sent.popleft()
        for _, chain in sent:
            self._add(held, chain)
        self._held[worker_id] = held
        self._trim(held)

    def sent(self, worker_id: str, chains: Iterable[Sequence[str]], at: float) -> None:
        """Items with these keys went to the worker at ``at`` (wall clock): it will hold them once it runs them."""
        held = self._held.setdefault(worker_id, OrderedDict())
        recent = self._sent.setdefault(worker_id, deque())
        for chain in chains:
            self._add(held, chain)
            recent.append((at, chain))
        while recent and recent[0][0] < at - SENT_KEPT_S:
            recent.popleft()
        self._trim(held)

    @staticmethod
    def _add(held: OrderedDict[str, None], chain: Sequence[str]) -> None:
        for key in reversed(chain):  # a chain's head the most recent: trimming takes its tail first
            held[key] = None
            held.move_to_end(key)

    def match(self, worker_id: str, keys: Sequence[str]) -> int:
        """How many of the leading ``keys`` the worker holds."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def home(self, keys: Sequence[str], worker_ids: Iterable[str]) -> tuple[str | None, int]:
        """The worker among these holding most of the start these keys name, and how many chunks of it (at
        least :data:`MIN_MATCH_CHUNKS`; ``(None, 0)``: none does). Ties go to the first in ``worker_ids``."""
        best, best_match = None, 0
        if len(keys) >= MIN_MATCH_CHUNKS:
            for worker_id in worker_ids:
                match = self.match(worker_id, keys)
                if match >= MIN_MATCH_CHUNKS and match > best_match:
                    best, best_match = worker_id, match
        return best, best_match

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)
        self._reported.pop(worker_id, None)
        self._sent.pop(worker_id, None)

    def _trim(self, held: OrderedDict[str, None]) -> None:
        while len(held) > self.keys_per_worker:
            held.popitem(last=False)


@dataclass(frozen=True)
class Option:
    """A worker able to take a batch now, with its load: the share of its capacity it has outstanding (estimated
    KV tokens of a generation model's batches over its KV budget; batches over its batch limit otherwise)."""

    worker_id: str
    load: float


def assign(items: Sequence[Sequence[str]], options: Sequence[Option], index: PrefixIndex) -> list[int]:
    """For each item (its prefix keys), the position in ``options`` (best first: the scheduler's order) of the
    worker it should go to: the highest score, ``PREFIX_WEIGHT`` x the share of the item's keys the worker holds
    less ``LOAD_WEIGHT`` x its load (llm-d's weighted scorers, on the same two signals), a match of fewer than
    :data:`MIN_MATCH_CHUNKS` chunks counting as none; ties go to the scheduler's order. An item no option holds
    the start of stays with the scheduler's choice (its order already weighs backlog, KV room and lead)."""
    if len(options) < 2:
        return [0] * len(items)
    out = []
    for keys in items:
        held = [held_share(index, option.worker_id, keys) for option in options]
        best = 0
        if any(held):
            best_score = float("-inf")
            for i, option in enumerate(options):
                score = PREFIX_WEIGHT * held[i] - LOAD_WEIGHT * option.load
                if score > best_score:
                    best, best_score = i, score
        out.append(best)
    return out


def held_share(index: PrefixIndex, worker_id: str, keys: Sequence[str]) -> float:
    """The share of an item's keys the worker holds (0 below :data:`MIN_MATCH_CHUNKS` chunks)."""
    match = index.match(worker_id, keys) if len(keys) >= MIN_MATCH_CHUNKS else 0
    return match / len(keys) if match >= MIN_MATCH_CHUNKS else 0.0
