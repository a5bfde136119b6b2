"""Each row's own logits inside continuous batching: its grammar's mask and OpenAI's penalties and logit bias.

One more logits processor of transformers' manager, first in line (before temperature, top_p and the seeded noise
of :mod:`gpu_worker.backends.seeded_sampling`), so that a constrained row's draw is among the tokens its grammar
allows and a penalised one's among its shaped logits. When the manager prepares a step (its batch is known),
each shaped row's tokens generated since the last step are fed to its matcher and counted, and its additive
row (-inf where the grammar forbids; bias - presence*[count>0] - frequency*count elsewhere) is built on the CPU;
the step adds it to that row's logits. Free rows pay nothing. This needs the manager to finish a step before it
prepares the next (no asynchronous batching, no CUDA graphs: :func:`gpu_worker.backends.continuous` sets both).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

from gpu_worker.backends.generation import Row
from gpu_worker.backends.grammar import RowGrammar

FREE = -1  # a row with nothing to add
_BITS = torch.arange(8, dtype=torch.uint8)


@dataclass(eq=False)
class Shaping:
    """A row being shaped: its parameters, its matcher (None when unconstrained), the tokens seen so far."""

    row: Row
    grammar: RowGrammar | None
    seen: int = 0
    counts: dict[int, int] | None = None
    error: str = ""  # the grammar's, once it erred (over its limits): the row is then ended


def mask_row(mask: bytes, vocab: int) -> torch.Tensor:
    """A grammar's bit mask as a boolean row of ``vocab`` tokens (tokens past the grammar's vocabulary: False)."""
    bits = (torch.frombuffer(bytearray(mask), dtype=torch.uint8).unsqueeze(-1) >> _BITS) & 1
    allowed = bits.flatten().bool()[:vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.numel())) if allowed.numel() < vocab else allowed


def additive(shaping: Shaping, tokens: list[int], vocab: int) -> torch.Tensor:
    """What to add to the row's logits for its next token, given every token it generated."""
    row = shaping.row
    for token in tokens[shaping.seen:]:  # the tokens chosen since the last step
        if shaping.grammar is not None and not shaping.grammar.consume(token):
            shaping.error = shaping.grammar.error or "a token the grammar did not allow"
        if row.shaped:
            shaping.counts = shaping.counts or {}
            shaping.counts[token] = shaping.counts.get(token, 0) + 1
    shaping.seen = len(tokens)
    out = torch.zeros(vocab)
    if row.shaped:
        for token, count in (shaping.counts or {}).items():
            if token < vocab:
                out[token] -= row.presence + row.frequency * count
        for token, bias in row.bias.items():
            if 0 <= token < vocab:
                out[token] += bias
    if shaping.grammar is not None:
        allowed = mask_row(shaping.grammar.mask(), vocab)
        if shaping.grammar.error:
            shaping.error = shaping.grammar.error
        if allowed.any():
            out.masked_fill_(~allowed, float("-inf"))
    return out


class RowShaping(ContinuousBatchingLogitsProcessor):
    """The logits processor: rows are registered by request id; the step's additive rows are built when the step
    is prepared and added when it runs."""

    supported_kwargs: dict[str, type] = {}  # noqa: RUF012 (transformers declares it so)
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.rows: dict[str, Shaping] = {}
        self.lock = threading.Lock()
        self._step: torch.Tensor | None = None

    def add(self, request_id: str, shaping: Shaping) -> None:
        with self.lock:
            self.rows[request_id] = shaping

    def drop(self, request_id: str) -> Shaping | None:
        with self.lock:
            return self.rows.pop(request_id, None)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(FREE)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        slots: list[int] = []
        rows: list[torch.Tensor] = []
        for future in requests_with_new_token:
            state = future.state
            with self.lock:
                shaping = self.rows.get(state.request_id)
            if shaping is None:
                slots.append(FREE)
                continue
            prompt = state._true_initial_tokens
            tokens = (state.initial_tokens[prompt:] if prompt else []) + list(state.generated_tokens)
            slots.append(len(rows))
            rows.append(additive(shaping, tokens, self.vocab))
        self._step = torch.stack(rows) if rows else None
        return torch.tensor(slots, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if self._step is None:
            return scores
        slots = tensor_arg[: scores.size(0)].to(scores.device)
        step = self._step.to(scores.device, scores.dtype)
        width = scores.size(-1)
        if step.size(-1) != width:  # the model's logits may be padded past the tokenizer's vocabulary
            step = torch.nn.functional.pad(step[:, :width], (0, max(0, width - step.size(-1))), value=float("-inf"))
        # A row past those prepared (the manager pads the step's sequences, and the padding's arguments are left
        # from an earlier step) is free: its logits are not read.
        shaped = (slots >= 0) & (slots < step.size(0))
        extra = step[torch.where(shaped, slots, 0).long()]
        return torch.where(shaped.unsqueeze(-1), scores + extra, scores)
