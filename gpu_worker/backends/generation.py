"""What both text-generation engines (padded ``generate()`` and continuous batching) share, free of torch.

The stop rule lives here once: output is cut at the first stop sequence, and while streaming, text that
could still turn out to be the start of one is held back until more text shows it is not. Keeping it pure
means it is tested without a model, and neither engine imports the other to reach it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tasks.schema import Entry, GenerationOutput, SamplingParams

HALF_CHARACTER = "\ufffd"  # what a decoder shows for a multi-byte character whose other tokens are to come


@dataclass
class Row:
    """One item to generate for: its position in the batch, prompt tokens, token budget and stop sequences."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    logprobs: int | None = None  # how many likeliest tokens to give at each position (None: no logprobs)
    echo: bool = False  # the prompt's tokens and their logprobs too (scoring a given text, max_tokens 0)
    temperature: float = 1.0  # the API's default; 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # a sampled row's draws repeat for the same seed (None: a fresh one)
    prefix: tuple[str, ...] = ()  # the batchers' names of its input's start (tasks.policy.prefixes)
    input_chars: int = 0  # its input's length in characters (to map those names to prompt pages)
    grammar: str | None = None  # what constrains its tokens (llguidance's Lark syntax)
    presence: float = 0.0  # OpenAI's presence and frequency penalties, and its logit bias by token id
    frequency: float = 0.0
    bias: dict[int, float] = field(default_factory=dict)
    adapter: str | None = None  # its LoRA adapter's name (None: the base model)

    @classmethod
    def from_params(cls, index: int, prompt_ids: list[int], params: SamplingParams) -> Row:
        """The API has validated ``params``; a backend called directly without ``max_tokens`` generates 16."""
        return cls(index, prompt_ids, 16 if params.max_tokens is None else params.max_tokens, list(params.stop),
                   params.logprobs, params.echo, float(params.temperature), float(params.top_p or 1.0), params.seed,
                   grammar=params.grammar, presence=float(params.presence_penalty),
                   frequency=float(params.frequency_penalty), bias={int(t): float(b) for t, b in params.logit_bias},
                   adapter=params.adapter)

    @property
    def shaped(self) -> bool:
        """Whether its logits are penalised or biased (OpenAI's presence, frequency and logit_bias)."""
        return bool(self.presence or self.frequency or self.bias)

    @property
    def scored(self) -> bool:
        """Whether its answer carries log-probabilities (see :func:`with_logprobs`)."""
        return self.logprobs is not None or self.echo


def penalty(token: int, count: int, row: Row) -> float:
    """What OpenAI adds to ``token``'s logit: its bias, less the presence penalty if it was generated at all and
    the frequency penalty for each time it was (``count``)."""
    return row.bias.get(token, 0.0) - row.presence * (count > 0) - row.frequency * count


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to its earliest stop sequence, and whether there was one."""
    cut = min((text.index(s) for s in stop if s in text), default=None)
    return (text, False) if cut is None else (text[:cut], True)


class StopText:
    """The stop rule for one streamed row: fed its whole decoded text at each step (decoders re-decode all
    tokens, since a token's text depends on its neighbours), it says what may be sent now and whether a stop
    sequence has been hit. It holds back the last (longest stop - 1) characters, which could be the start of
    a stop sequence, and half characters; the final text, sent with the result, is authoritative."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0  # characters handed out so far
        self.stopped = False

    def feed(self, text: str) -> str:
        """The new text that is safe to stream, given all the text decoded so far ("" for none yet)."""
        visible, self.stopped = cut_at_stop(text, self.stop)
        if not self.stopped:
            visible = visible[:max(self.sent, len(visible) - self.hold)]
        if visible.endswith(HALF_CHARACTER) or len(visible) <= self.sent:
            return ""
        delta, self.sent = visible[self.sent:], len(visible)
        return delta

    def final(self, text: str) -> str:
        """The whole answer for the row's final decoded text: cut at its first stop sequence."""
        return cut_at_stop(text, self.stop)[0]

    def flush(self, text: str) -> str:
        """What is still to be sent of the final text (the API sends it with the last chunk)."""
        rest = self.final(text)[self.sent:]
        self.sent += len(rest)
        return rest


def completion(tokenizer: Any, row: Row, tokens: list[int], finish: str) -> GenerationOutput:
    """A row's answer: its text cut at the first stop sequence, the finish reason and its token counts."""
    text, stopped = cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), row.stop)
    if stopped:  # count what is sent, not what was generated past the stop
        finish, tokens = "stop", tokenizer(text, add_special_tokens=False)["input_ids"]
    # a scored row keeps the tokens sent, for the backend to score (:func:`with_logprobs` drops them again)
    return GenerationOutput(text, finish, len(row.prompt_ids), len(tokens),
                            token_ids=tuple(tokens) if row.scored else None)



def with_logprobs(output: GenerationOutput, row: Row, prompt: str,
                  score: Callable[[list[int], int, int], list[Entry]]) -> GenerationOutput:
    """``output`` with the log-probabilities its row asked for: ``logprobs``, one entry per completion token,
    and with ``echo`` also ``prompt`` and ``prompt_logprobs`` (one per prompt token). ``score(ids, start, top)``
    gives the entries of ``ids[start:]`` with the ``top`` likeliest tokens at each, from the backend's model."""
    ids = output.token_ids
    if ids is None or not row.scored:
        return output
    everything = row.prompt_ids + list(ids)
    start = 0 if row.echo else len(row.prompt_ids)
    entries = score(everything, start, row.logprobs or 0)
    prompt_entries, entries = entries[:len(row.prompt_ids) - start], entries[len(row.prompt_ids) - start:]
    if row.echo:
        return replace(output, logprobs=entries, prompt=prompt, prompt_logprobs=prompt_entries, token_ids=None)
    return replace(output, logprobs=entries, token_ids=None)
