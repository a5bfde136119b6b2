"""What a model backend is to its worker: the model is a black box that maps N inputs to N outputs, in order.

An output may be an :class:`ItemError` for one input the model cannot take (a prompt longer than its context):
that item is answered with the error and the rest of the batch goes on. Backends import this module only;
:mod:`gpu_worker.backends.registry` builds them by name.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from tasks.schema import EmbeddingOutput, GenerationOutput, SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class ItemError:
    type: str  # an error type the API maps to a status, e.g. "invalid_request"
    message: str


# one item's outcome: generated text, an embedding, the sim model's digest, or an error for that item alone
Output = GenerationOutput | EmbeddingOutput | str | ItemError
Generated = GenerationOutput | ItemError  # a generating backend's
Outputs = dict[int, Generated]  # a generating backend's outputs as its rows finish, by position in the batch


def in_order(outputs: Mapping[int, T], count: int) -> list[T]:
    """Every position's output, in order (KeyError if one is missing: the batch then goes back, never half-answered)."""
    return [outputs[i] for i in range(count)]


@dataclass
class Hooks:
    """How a generating backend talks back while it runs, by item position in the batch."""

    streaming: set[int] = field(default_factory=set)  # items whose text should be streamed as it comes
    stream: Callable[[list[tuple[int, str]]], None] = lambda deltas: None  # called once per decoding step
    cancelled: Callable[[int], bool] = lambda position: False  # the caller is gone: stop generating for it
    # a row finished before the rest of its batch (continuous batching): its caller may be answered now
    done: Callable[[int, Output], None] = lambda position, output: None


@dataclass(frozen=True)
class PrefixCache:
    """A generating backend's prefix cache, for its heartbeat: whole prompt pages looked up on admission since it
    started, those found there (not prefilled again), the prompt pages it holds or caches now, and which prompt
    starts those are (for the batchers' prefix-aware routing)."""

    caching: bool = False  # whether it keeps one at all
    queries: int = 0
    hits: int = 0
    blocks: int = 0
    keys: tuple[str, ...] = ()  # the prefix keys (tasks.policy.prefixes) whose pages it holds now


NO_PREFIX_CACHE = PrefixCache()


@dataclass(frozen=True)
class AdapterState:
    """A backend's LoRA adapters, for its heartbeat (tasks.policy.adapter_residency): how many it may hold (0: it
    serves none), those resident now (most recently used first) and loading, loads and evictions since it
    started."""

    max_adapters: int = 0
    resident: tuple[str, ...] = ()
    loading: tuple[str, ...] = ()
    loads: int = 0
    evictions: int = 0


NO_ADAPTERS = AdapterState()


class Backend(Protocol):
    name: str  # the model name this backend serves; requests are routed by it
    kind: str  # "sim", "causal" or "embed": which API endpoints it can answer
    max_batch: int  # most inputs one run() takes
    max_context: int  # most tokens per item (prompt and output); 0 when it does not apply
    slots: int  # batches it runs at once (1 but for continuous batching)

    def run(self, inputs: Sequence[str], params: Sequence[SamplingParams] | None = None,
            hooks: Hooks | None = None) -> Sequence[Output]:
        """Outputs for ``inputs``: same length, same order. Raise on failure; never return a partial list."""
        ...
