"""sim-lm's tokeniser and text: what a prompt's tokens are and what its answer says, as pure functions of the prompt
and the sampling key (see :mod:`gpu_worker.backends.sim_lm_engine` for the model as a whole)."""
from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence

# -- tokeniser and text -------------------------------------------------------------------------------------
_PIECES = re.compile(r" ?\w+| ?[^\w\s]|\s")
_CONSONANTS, _VOWELS = "bdfghklmnprstvz", "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]
WORDS = [" " + a for a in _SYLLABLES] + [" " + a + b for a in _SYLLABLES for b in _SYLLABLES]
VOCAB = [".", ","] + WORDS  # token id -> text; every entry is one token to the tokeniser


class SimTokenizer:
    """Deterministic word-piece tokeniser, shaped like a Hugging Face tokenizer where
    :func:`gpu_worker.backends.generation.completion` uses one (``__call__`` and ``decode``)."""

    def pieces(self, text: str) -> list[str]:
        out = []
        for piece in _PIECES.findall(text):
            word = piece.lstrip(" ")
            if len(word) <= 6:
                out.append(piece)
                continue
            lead = piece[:len(piece) - len(word)]
            out += [lead + word[:4]] + [word[i:i + 4] for i in range(4, len(word), 4)]
        return out

    def encode(self, text: str) -> list[int]:
        return [int.from_bytes(hashlib.blake2b(p.encode(), digest_size=4).digest(), "big") for p in self.pieces(text)]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids)


GREEDY = b"greedy"


def sampling_key(temperature: float, top_p: float, seed: int | None, fresh: Callable[[], bytes]) -> bytes:
    """What, besides the prompt, a request's tokens depend on: nothing for greedy decoding, else the sampling
    parameters and the seed (``fresh()`` randomness when there is none: every call then differs)."""
    if temperature == 0:
        return GREEDY
    return f"t={temperature!r},p={top_p!r},".encode() + (str(seed).encode() if seed is not None else fresh())


class Text:
    """The deterministic answer to one prompt under one sampling key."""

    def __init__(self, prompt: str, key: bytes) -> None:
        self.root = hashlib.blake2b(prompt.encode() + b"\0" + key, digest_size=16).digest()

    def _hash(self, label: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(self.root + label, digest_size=8).digest(), "big")

    def token(self, position: int) -> int:
        h = self._hash(position.to_bytes(4, "big"))
        r = h % 1000
        if r < 40:
            return 0  # "."
        if r < 70:
            return 1  # ","
        return 2 + (h >> 10) % len(WORDS)

    def eos(self, mean: float) -> int | None:
        """Tokens before the end-of-sequence token: geometric with mean ``mean``; None when EOS is off."""
        if mean <= 0:
            return None
        if mean <= 1:
            return 1
        u = (self._hash(b"eos") + 1) / 2.0**64  # in (0, 1]
        return 1 + int(math.log(u) / math.log(1 - 1 / mean))
