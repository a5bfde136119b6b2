"""Constrained decoding row by row: a row's grammar (``SamplingParams.grammar``, llguidance's Lark syntax) compiled
once, off the decoding loop, and applied at every step as a token mask.

Why llguidance: its masks cost tens of microseconds per row (MaskBench: 47 µs mean, 460 µs p99, against xgrammar's
292 µs / 4.9 ms), it compiles lazily (no per-vocabulary pre-pass), and it bounds the work of a hostile grammar with
its parser limits instead of hanging. Why a pool and a cache: one step holds every row of the batch, so compiling
there would stall all of them; the same schema comes back again and again (an agent's tools, an extractor's
schema), so it is compiled once (the cache is keyed by the grammar text, least recently used out first, failures
included, so a bad grammar sent in a loop costs one compile). A row whose grammar is not ready waits outside the
batch; a grammar that does not compile, or exceeds the limits, fails its row alone.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import llguidance

from gpu_worker.backends.interface import ItemError

MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar longer than this is refused before compiling
CACHE_ENTRIES = 256  # compiled grammars kept, least recently used out first
COMPILE_WORKERS = 2


def limits() -> llguidance.LLParserLimits:
    """Bounds on one grammar's work, so that a hostile one fails its row instead of stalling the worker: the
    lexer's build and per-step fuel (about 50k and 14k a millisecond: 20 ms and 10 ms at most), the Earley items of
    a step, the lexer's states and the grammar's size. Errors say nothing of the grammar's internals."""
    return llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=150_000, step_max_items=50_000,
                                     max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False)


def token_list_tokenizer(tokens: Sequence[bytes], eos: int, encode: Any) -> llguidance.LLTokenizer:
    """An llguidance tokenizer for a vocabulary given as each token's bytes (``encode(bytes) -> ids``)."""

    class Vocabulary:
        eos_token_id = eos
        bos_token_id = None
        special_token_ids: ClassVar[list[int]] = [eos]

        def __init__(self) -> None:
            self.tokens = list(tokens)

        def __call__(self, data: bytes) -> list[int]:
            return list(encode(data))

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()))


def hf_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """An llguidance tokenizer for a Hugging Face fast tokenizer (about a second for a large vocabulary: once)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


class RowGrammar:
    """One row's matcher: the mask of the tokens its grammar allows next, and the tokens it chose."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: int) -> None:
        self.matcher = matcher
        self.eos = eos

    def mask(self) -> bytes:
        """One bit per token of the vocabulary (little-endian within each byte): 1 where it is allowed."""
        return self.matcher.compute_bitmask()

    def forced(self) -> list[int]:
        """The tokens the grammar requires next, whatever is chosen (none when there is a choice)."""
        return self.matcher.compute_ff_tokens()

    def consume(self, token: int) -> bool:
        """Feed the chosen token; False if the grammar did not allow it (the matcher is then in error)."""
        return self.matcher.consume_token(token)

    @property
    def stopped(self) -> bool:
        """Nothing more may follow (the grammar is complete, or in error)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def allows(mask: bytes, token: int) -> bool:
    byte = token >> 3
    return byte < len(mask) and bool(mask[byte] >> (token & 7) & 1)


def allowed_count(mask: bytes) -> int:
    return int.from_bytes(mask, "little").bit_count()


def nth_allowed(mask: bytes, n: int) -> int:
    """The ``n``-th allowed token (from 0, in id order), for a choice among them; -1 if there are fewer."""
    for byte_index, byte in enumerate(mask):
        count = byte.bit_count()
        if n < count:
            for bit in range(8):
                if byte >> bit & 1:
                    if n == 0:
                        return byte_index * 8 + bit
                    n -= 1
        n -= count
    return -1


Compiled = llguidance.LLMatcher | ItemError


class Grammars:
    """Grammars compiled for one tokenizer: on a small pool, cached by text. :meth:`compile` never blocks the
    caller; :meth:`row` gives a fresh matcher (a copy of the compiled one) or the row's :class:`ItemError`."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, *, entries: int = CACHE_ENTRIES,
                 workers: int = COMPILE_WORKERS, max_chars: int = MAX_GRAMMAR_CHARS) -> None:
        self.tokenizer = tokenizer
        self.entries = entries
        self.max_chars = max_chars
        self.hits = self.misses = 0
        self._cache: OrderedDict[str, Future[Compiled]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_token

    def compile(self, grammar: str) -> Future[Compiled]:
        """The grammar's compiled matcher (or the error it fails with), as a future shared by every row that asks
        for the same text while it is cached."""
        with self._lock:
            made = self._cache.get(grammar)
            if made is not None:
                self.hits += 1
                self._cache.move_to_end(grammar)
                return made
            self.misses += 1
            made = self._pool.submit(self._compile, grammar)
            self._cache[grammar] = made
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)
            return made

    def _compile(self, grammar: str) -> Compiled:
        if len(grammar) > self.max_chars:
            return ItemError("invalid_request", f"the grammar has {len(grammar)} characters: more than the "
                             f"{self.max_chars} this worker compiles")
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits())
        except Exception as exc:  # API misuse only (the matcher reports grammar errors as its state)
            return ItemError("invalid_request", f"the grammar does not compile: {exc}")
        if matcher.is_error():
            return ItemError("invalid_request", f"the grammar does not compile: {matcher.get_error()[:500]}")
        return matcher

    def row(self, compiled: Compiled) -> RowGrammar | ItemError:
        """A row's own matcher from a compiled grammar."""
        if isinstance(compiled, ItemError):
            return compiled
        return RowGrammar(compiled.deep_copy(), self.eos)

    def now(self, grammar: str, timeout: float | None = None) -> RowGrammar | ItemError:
        """A row's matcher, waiting for its compilation (static batches, tests)."""
        return self.row(self.compile(grammar).result(timeout))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
