"""What a generation request will cost, in tokens, before anyone has tokenised it.

For a generation model the device's work, and the KV memory an item holds, is its prompt plus its output
tokens, not "one item": a 2,000-token prompt costs a hundred times a 20-token one. Token-fair sharing
(:mod:`tasks.policy.fairness`), KV-aware routing (:mod:`tasks.policy.scheduler`) and the door's "can this ever
fit" check need that number where no tokenizer runs (the API processes and the batcher never load a model),
so it is estimated from the text: about four characters a token for English under the BPE vocabularies of
current LLMs, plus the whole ``max_tokens`` the request may generate. The worker reports the real count when
the item is done (prompt and completion tokens), and fairness is corrected by the difference.

An item with no ``max_tokens`` (an embedding, the sim model, a black box) costs one unit: item-count fairness.
"""
from __future__ import annotations

import math

from tasks.schema import SamplingParams

CHARS_PER_TOKEN = 4.0


def prompt_tokens(text: str) -> int:
    """Estimated tokens of a prompt (at least one)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def least_prompt_tokens(text: str) -> int:
    """A lower bound on a prompt's tokens under any byte-level vocabulary: no token holds more than 16 bytes of
    ordinary text, so a prompt of N bytes is at least N / 16 tokens. What the door may refuse on."""
    return max(1, math.ceil(len(text.encode("utf-8", "surrogatepass")) / 16))


def generation_budget(params: SamplingParams) -> int | None:
    """The output tokens an item may generate (its ``max_tokens``), or None for a non-generation item."""
    max_tokens = params.max_tokens
    return max_tokens if max_tokens is not None and max_tokens > 0 else None


def estimated_tokens(text: str, params: SamplingParams) -> int | None:
    """Prompt plus output tokens an item may take (its KV footprint at the end), or None for a non-generation
    item."""
    budget = generation_budget(params)
    return None if budget is None else prompt_tokens(text) + budget


def cost(text: str, params: SamplingParams) -> float:
    """An item's share of the device in fairness units: its estimated tokens, or 1 for a black-box item."""
    tokens = estimated_tokens(text, params)
    return 1.0 if tokens is None else float(tokens)
