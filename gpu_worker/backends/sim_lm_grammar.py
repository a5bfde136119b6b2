"""How sim-lm chooses a constrained row's tokens: among those its grammar's mask allows, as a model's sampler
would after the mask, deterministically from the row's prompt and sampling key.

Its vocabulary (:data:`gpu_worker.backends.sim_lm_text.TOKEN_BYTES`: its words with and without their space,
JSON's punctuation, every byte, an end-of-sequence token) is a real one to llguidance, so a mask means what it does
on a real model. The choice: the token the unconstrained model would have given there when the mask allows it
(so text inside a JSON string reads as sim-lm's text), else one drawn among the allowed ones; and, as a trained
model does, it leans toward closing: at each step a fixed chance, and always once the row is long enough, of
the first allowed of the tokens that end the structure (end of sequence, closing brackets and quotes). What the
grammar requires (a strict schema's keys, an enum's value) is forced by the mask, so the answer is complete well
before ``max_tokens`` unless the schema itself needs more.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from gpu_worker.backends.generation import Row, penalty
from gpu_worker.backends.grammar import Grammars, RowGrammar, allowed_count, allows, nth_allowed, token_list_tokenizer
from gpu_worker.backends.sim_lm_text import BYTES_FROM, EOS, TOKEN_BYTES, WORDS, byte_tokens

CLOSE_PER_MILLE = 150  # the chance of closing at each step, before the row is long enough to close always
_IDS = {t: i for i, t in enumerate(TOKEN_BYTES) if i < BYTES_FROM}
_BYTE = {chr(b): BYTES_FROM + b for b in range(128)}
# the tokens that end a structure, best first: inside a JSON string (its closing quote first), and outside one
IN_STRING = (EOS, _IDS[b'"}'], _IDS[b'"]'], _BYTE['"'], _IDS[b'",'])
OUTSIDE = (EOS, _IDS[b"}]"], _BYTE["}"], _BYTE["]"], _BYTE[","], _IDS[b", "])
TOOL_CALL = _IDS[b"<tool_call>"]
WHITESPACE = frozenset([*(_BYTE[c] for c in " \t\n\r"), _IDS[b"\n"]])

_grammars: Grammars | None = None
_lock = threading.Lock()


def sim_grammars() -> Grammars:
    """The grammars compiled for sim-lm's vocabulary, one cache and pool per process (built on first use)."""
    global _grammars
    with _lock:
        if _grammars is None:
            _grammars = Grammars(token_list_tokenizer(TOKEN_BYTES, EOS, byte_tokens))
        return _grammars


def close_after(max_tokens: int) -> int:
    """Tokens after which a constrained row always closes what it can."""
    return max(16, min(max_tokens // 2, 256))


def in_string(text: str) -> bool:
    """Whether ``text`` ends inside a JSON string (an odd number of unescaped quotes)."""
    inside = escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\" and inside:
            escaped = True
        elif c == '"':
            inside = not inside
    return inside


def choose(grammar: RowGrammar, natural: int, draw: int, late: bool, inside: bool, *, first: bool = False,
           call: bool = False) -> int:
    """The row's next token: ``natural`` is the unconstrained model's, ``draw`` a 64-bit draw of the row's own,
    ``late`` whether it is long enough to close always, ``inside`` whether its text ends inside a JSON string,
    ``first`` whether it is the answer's first token (an answer is not empty when it may be something) and
    ``call`` whether to open a tool call there when the grammar allows one (as an agent's model does when the
    user has spoken and tools are offered). EOS when nothing is allowed (the grammar is done)."""
    mask = grammar.mask()
    count = allowed_count(mask)
    if count == 0:
        return EOS
    if first and call and allows(mask, TOOL_CALL):
        return TOOL_CALL
    if late or draw % 1000 < CLOSE_PER_MILLE:
        for token in IN_STRING if inside else OUTSIDE:
            if allows(mask, token) and not (first and token == EOS and count > 1):
                return token
    if allows(mask, natural):
        return natural
    forced = grammar.forced()
    if forced:  # what the grammar requires next (a key, the rest of an enum's value): its longest tokens
        return forced[0]
    for k in range(4):  # a few draws over the whole vocabulary before counting the allowed ones
        token = (draw >> (10 + 12 * k)) % EOS
        if allows(mask, token) and token not in WHITESPACE:
            return token
    start = (draw >> 8) % count
    for n in range(min(count, 8)):  # the drawn one, or the next that is not whitespace
        token = nth_allowed(mask, (start + n) % count)
        if token not in WHITESPACE:
            return token
    return nth_allowed(mask, start)


def shaped(natural: int, draw: int, tokens: Sequence[int], row: Row) -> int:
    """An unconstrained row's token under OpenAI's penalties and logit bias (sim-lm has no logits, so it gives
    its natural token a logit of 1, three other words and each positively biased token 0), each plus
    :func:`~gpu_worker.backends.generation.penalty`: the best wins, the natural token on a tie."""
    counts = Counter(tokens)
    others = [2 + (draw >> (16 * k)) % len(WORDS) for k in range(3)]
    biased = [t for t, b in row.bias.items() if b > 0 and 0 <= t < EOS]
    return max([natural, *others, *biased],
               key=lambda t: (t == natural) + penalty(t, counts[t], row))
