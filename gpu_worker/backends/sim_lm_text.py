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
VOCAB = [".", ",", *WORDS]  # token id -> text; every entry is one token to the tokeniser
# the rest of the vocabulary, which only constrained rows choose from (what a grammar needs, as in a real model's
# byte-level vocabulary): the words without their space, JSON's punctuation, every byte, and the end of sequence
JSON_PIECES = ['{"', '":', '":"', '","', '",', '"}', '"]', '["', '[{', '}]', '},{', ': ', ', ', "true", "false",
               "null", "<tool_call>", "</tool_call>", '"name"', '"arguments"', "\n"]
BYTES_FROM = len(VOCAB) + len(WORDS) + len(JSON_PIECES)
TOKEN_BYTES = [t.encode() for t in (*VOCAB, *(w[1:] for w in WORDS), *JSON_PIECES)] + [bytes([b]) for b in range(256)]
EOS = len(TOKEN_BYTES)  # the end-of-sequence token: no text
TOKEN_BYTES.append(b"")


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
        if all(i < len(VOCAB) for i in ids):
            return "".join(VOCAB[i] for i in ids)
        return b"".join(TOKEN_BYTES[i] for i in ids).decode("utf-8", "replace")


def piece(token: int) -> str:
    """One token's text (a lone byte of a longer character shows as the replacement character)."""
    return VOCAB[token] if token < len(VOCAB) else TOKEN_BYTES[token].decode("utf-8", "replace")


_BY_BYTES = {t: i for i, t in reversed(list(enumerate(TOKEN_BYTES[:EOS])))}  # the lowest id of each text
_LONGEST = max(len(t) for t in TOKEN_BYTES)


def byte_tokens(data: bytes) -> list[int]:
    """``data`` tokenised greedily, longest token first (how a grammar's forced text is written: any tokenisation
    is valid to the grammar, and the longest takes the fewest steps)."""
    out, at = [], 0
    while at < len(data):
        for size in range(min(_LONGEST, len(data) - at), 0, -1):
            token = _BY_BYTES.get(data[at:at + size])
            if token is not None:
                out.append(token)
                at += size
                break
    return out


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

    def draw(self, position: int) -> int:
        """A 64-bit draw of its own at ``position``, for a constrained row's choice among the allowed tokens."""
        return self._hash(b"c" + position.to_bytes(4, "big"))

    def eos(self, mean: float) -> int | None:
        """Tokens before the end-of-sequence token: geometric with mean ``mean``; None when EOS is off."""
        if mean <= 0:
            return None
        if mean <= 1:
            return 1
        u = (self._hash(b"eos") + 1) / 2.0**64  # in (0, 1]
        return 1 + int(math.log(u) / math.log(1 - 1 / mean))


def sim_logprobs(pieces: Sequence[str], start: int, top: int) -> list[dict[str, object]]:
    """Log-probabilities for sim-lm's tokens ``pieces[start:]`` (token texts), deterministic functions of the text
    up to each token: the token there has probability 0.4-0.999 and is the likeliest (as the greedy decoding that
    picked it would have it); the ``top`` likeliest are it and other words of the vocabulary, sharing what is
    left, halving each time, so each position's probabilities sum to at most 1. The first token of a text has
    none (nothing predicts it), as in OpenAI's answers."""
    entries: list[dict[str, object]] = []
    for t in range(start, len(pieces)):
        if t == 0:
            entries.append({"token": pieces[0], "logprob": None, "top": None})
            continue
        digest = hashlib.blake2b("".join(pieces[:t + 1]).encode(), digest_size=16).digest()
        h = int.from_bytes(digest, "big")
        p = 0.4 + 0.599 * (h % 10_000) / 10_000
        likeliest: list[list[object]] = [[pieces[t], math.log(p)]]
        seen, k = {pieces[t]}, 0
        while len(likeliest) < top:
            k += 1
            word = WORDS[(h >> (7 * k)) % len(WORDS)] if k < 18 else f" alt{k}"
            if word not in seen:
                seen.add(word)
                likeliest.append([word, math.log((1 - p) * 0.5 ** len(likeliest))])
        entries.append({"token": pieces[t], "logprob": math.log(p), "top": likeliest[:top]})
    return entries
