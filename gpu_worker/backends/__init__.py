"""Model backends: the model is a black box that maps N inputs to N outputs, in order.

Backends are looked up by name so that heavy ones (torch, transformers) are imported only by the workers
that use them. An output may be an :class:`ItemError` for one input the model cannot take (a prompt longer
than its context): that item is answered with the error and the rest of the batch goes on.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tasks.config import HfMode, Settings

KINDS = ("sim", "sim-lm", "hf-causal", "hf-embed")


@dataclass(frozen=True)
class ItemError:
    type: str  # an error type the API maps to a status, e.g. "invalid_request"
    message: str


@dataclass
class Hooks:
    """How a generating backend talks back while it runs, by item position in the batch."""

    streaming: set[int] = field(default_factory=set)  # items whose text should be streamed as it comes
    stream: Callable[[list[tuple[int, str]]], None] = lambda deltas: None  # called once per decoding step
    cancelled: Callable[[int], bool] = lambda position: False  # the caller is gone: stop generating for it
    # a row finished before the rest of its batch (continuous batching): its caller may be answered now
    done: Callable[[int, Any], None] = lambda position, output: None


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


class Backend(Protocol):
    name: str  # the model name this backend serves; requests are routed by it
    kind: str  # "sim", "causal" or "embed": which API endpoints it can answer
    max_batch: int  # most inputs one run() takes
    max_context: int  # most tokens per item (prompt and output); 0 when it does not apply
    slots: int  # batches it runs at once (1 but for continuous batching)

    def run(self, inputs: Sequence[str], params: Sequence[Mapping[str, Any]] | None = None,
            hooks: Hooks | None = None) -> list[Any]:
        """Outputs for ``inputs``: same length, same order. Raise on failure; never return a partial list."""
        ...


def device_for(gpu: int) -> str:
    """The device a worker pinned with CUDA_VISIBLE_DEVICES uses: its one GPU, or the CPU."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def load_backend(kind: str, settings: Settings, model: str | None = None, gpu: int = 0) -> Backend:
    """Build and warm up a backend; raises ValueError with the list of kinds for an unknown one."""
    if kind == "sim":
        from gpu_worker.backends.sim import SimBackend

        return SimBackend(name=model or "sim", batch_ms=settings.sim.batch_ms, item_ms=settings.sim.item_ms,
                          max_batch=settings.sim.max_batch, raise_on=settings.sim.raise_on,
                          kill_on=settings.sim.kill_on)
    if kind == "sim-lm":
        from gpu_worker.backends.sim_lm import SimLMBackend
        from gpu_worker.backends.sim_lm_engine import Timing

        return SimLMBackend(name=model or "sim-lm", mode=settings.sim.lm_mode, speed=settings.sim.lm_speed,
                            timing=Timing(settings.sim.lm_prefill_ms_per_token, settings.sim.lm_step_ms,
                                          settings.sim.lm_step_ms_per_seq),
                            kv_tokens=settings.sim.lm_kv_tokens, page_size=settings.sim.lm_page_size,
                            prefix_sharing=settings.sim.lm_prefix_sharing, max_seqs=settings.sim.lm_max_seqs,
                            slots=settings.sim.lm_slots, max_batch=settings.batcher.max_batch_size,
                            max_context=settings.sim.lm_max_context, eos_mean=settings.sim.lm_eos_mean)
    if kind == "hf-embed":
        from gpu_worker.backends.hf_embed import HFEmbedBackend, default_model_path

        path = model or default_model_path()
        return HFEmbedBackend(name=settings.models.served_name or _name_of(model, "all-MiniLM-L6-v2"), path=path,
                              device=device_for(gpu), max_batch=settings.batcher.max_batch_size)
    if kind == "hf-causal":
        if not model:
            raise ValueError("--backend hf-causal needs --model (a hub id such as Qwen/Qwen2.5-0.5B-Instruct, "
                             "or a local folder)")
        from gpu_worker.backends.continuous import EngineConfig
        from gpu_worker.backends.hf_causal import HFCausalBackend

        m = settings.models  # its mode an HfMode: a misspelt one stopped the process when its settings were read
        engine = EngineConfig(m.cb_num_blocks, m.cb_page_size, m.cb_max_batch_tokens,
                              m.cb_max_requests) if m.hf_mode is HfMode.CONTINUOUS else None
        return HFCausalBackend(name=settings.models.served_name or _name_of(model, model), path=model,
                               device=device_for(gpu), max_batch=settings.batcher.max_batch_size,
                               max_tokens_cap=settings.models.max_tokens_cap, continuous=engine,
                               slots=settings.models.cb_slots)
    raise ValueError(f"unknown backend {kind!r}; available: {', '.join(KINDS)}")


def _name_of(model: str | None, default: str) -> str:
    """A hub id names itself; a local folder is named after its last part."""
    if not model:
        return default
    return model.rstrip("/").split("/")[-1] if model.startswith(("/", ".")) else model
