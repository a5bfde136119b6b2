"""LoRA adapters in ``sim-lm``: what they cost a step, how long one takes to load, how many stay resident (pure).

The engine (:class:`gpu_worker.backends.sim_lm_engine.Engine`) asks this gate, each step and for each waiting
row with an adapter, whether the row may join the decoding batch: only once its adapter is resident, and only
if the step then holds at most ``per_step`` distinct adapters (vLLM's ``max_loras``, SGLang's
``max_loras_per_batch``: rows of a further adapter wait, the others keep stepping). A row whose adapter is not
resident asks for a load (:class:`~tasks.policy.adapter_residency.AdapterResidency` decides: room, evict the
least recently used unpinned adapter nobody runs, or wait); the load itself runs off the step loop (the backend
sleeps it in a thread of its own and calls :meth:`AdapterGate.loaded`), so rows of other adapters never wait
for it. Rows without an adapter pass untouched, and a step without adapters costs what it did.

Cost model, Llama-2-7B fp16 on an A100 80GB (the engine's defaults; :mod:`gpu_worker.backends.sim_lm_engine`):

- **a step with adapters** costs the base step x (1 + ``step_share`` x rank factor + ``extra_share`` x (distinct
  adapters - 1)). ``step_share`` 0.25: vLLM's figure for one rank-64 adapter on Llama-7B, a run about 25%
  slower than the base model (the issue's anchor). The rank factor is 0.5 + 0.5 x (largest rank in the step /
  64): half of the overhead is the LoRA kernels' fixed cost (launches, the gather of each row's adapter) and
  half grows with the rank (our assumption; rank 64 gives exactly vLLM's 25%, rank 8 about 14%).
  ``extra_share`` 0.02 a further distinct adapter: Punica's SGMV kernel runs a batch of distinct adapters
  within a few percent of a batch sharing one, and S-LoRA's throughput falls slowly with the number of
  adapters in the batch (its MBGMV kernels), so 4 distinct adapters cost about 6% more than one;
- **a load** costs ``load_fixed_ms`` + the adapter's bytes over ``load_gb_per_s``: the copy from host memory
  (S-LoRA keeps every adapter in host memory and copies the active ones to the GPU) over PCIe 4.0 x16, 32 GB/s
  in each direction on paper, about 25 GB/s measured from pinned host memory (NVIDIA's bandwidthTest); the
  fixed part (allocation, the adapter's slot in the LoRA kernels' tables) is an assumption, 5 ms. The bytes:
  rank x (d_in + d_out) x 2 bytes for each target module in each of the 32 layers: a rank-16 adapter on
  q_proj and v_proj (PEFT's default for Llama) is 16.8 MB, 5.7 ms; a rank-64 one on all seven linear layers
  is 320 MB, 18 ms.

The rank and target modules come from the adapter's ``adapter_config.json`` in its directory
(``params.adapter_path``) when the worker can read it, else ``default_rank`` on q_proj and v_proj.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from gpu_worker.backends.interface import AdapterState
from tasks.policy.adapter_residency import AdapterResidency

LLAMA2_7B_LAYERS = 32
# (d_in, d_out) of Llama-2-7B's linear layers, by PEFT's target module names
LLAMA2_7B_MODULES = {"q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096),
                     "o_proj": (4096, 4096), "gate_proj": (4096, 11008), "up_proj": (4096, 11008),
                     "down_proj": (11008, 4096)}
DEFAULT_TARGETS = ("q_proj", "v_proj")
REFERENCE_RANK = 64  # the rank vLLM's 25% figure was measured with


@dataclass(frozen=True)
class AdapterCosts:
    """The sim's adapter costs (``LLMB_SIM_LM_ADAPTER_*``; the fit is in the module docstring)."""

    step_share: float = 0.25  # a step's extra time with one rank-64 adapter, as a share of the base step
    extra_share: float = 0.02  # ... and per further distinct adapter in the step
    load_fixed_ms: float = 5.0
    load_gb_per_s: float = 25.0
    default_rank: int = 16

    def step_factor(self, ranks: Iterable[int]) -> float:
        """How many times the base step a step costs with adapters of these ranks (one per distinct adapter)."""
        ranks = list(ranks)
        if not ranks:
            return 1.0
        rank_factor = 0.5 + 0.5 * max(ranks) / REFERENCE_RANK
        return 1.0 + self.step_share * rank_factor + self.extra_share * (len(ranks) - 1)

    def load_ms(self, shape: AdapterShape) -> float:
        return self.load_fixed_ms + shape.bytes / (self.load_gb_per_s * 1e9) * 1000


@dataclass(frozen=True)
class AdapterShape:
    rank: int
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def bytes(self) -> int:
        """fp16 A and B matrices of every target module in every layer (unknown modules as q_proj)."""
        per_layer = sum(sum(LLAMA2_7B_MODULES.get(m, (4096, 4096))) for m in self.targets)
        return self.rank * per_layer * 2 * LLAMA2_7B_LAYERS


@lru_cache(maxsize=4096)
def adapter_shape(path: str | None, default_rank: int) -> AdapterShape:
    """The rank and target modules in ``path``/adapter_config.json; the default where it cannot be read."""
    if path:
        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                config = json.load(f)
            targets = config.get("target_modules") or DEFAULT_TARGETS
            if isinstance(targets, str):  # a regex in PEFT: count it as the default pair
                targets = DEFAULT_TARGETS
            return AdapterShape(int(config.get("r") or default_rank), tuple(str(t) for t in targets))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    return AdapterShape(default_rank)


@dataclass
class AdapterGate:
    """One sim-lm worker's adapters: residency, loads asked for, the per-step cap and the step's cost factor.
    Called under the backend's lock; ``start_load(name, ms)`` runs a load off the step loop (the backend's
    loader thread) and ends in :meth:`loaded`."""

    residency: AdapterResidency
    per_step: int
    costs: AdapterCosts
    start_load: Callable[[str, float], None]
    shapes: dict[str, AdapterShape] = field(default_factory=dict)
    hits: int = 0  # rows that found their adapter resident when they reached the worker
    misses: int = 0

    def arrived(self, name: str, path: str | None, pinned: bool) -> None:
        """A row of ``name`` reached the worker: count whether its adapter was resident, and ask for it."""
        self.shapes[name] = adapter_shape(path, self.costs.default_rank)
        if pinned:
            self.residency.pin(name)
        if name in self.residency.resident:
            self.hits += 1
        else:
            self.misses += 1
        self.want(name)

    def want(self, name: str) -> bool:
        """Whether ``name`` is resident; if not, start its load when there is room (else it waits)."""
        plan = self.residency.plan(name)
        if plan.load:
            self.residency.start_load(name, plan.evict)
            self.start_load(name, self.costs.load_ms(self.shapes.get(name) or AdapterShape(self.costs.default_rank)))
        return plan.ready

    def admits(self, name: str, running: set[str]) -> bool:
        """Whether a waiting row of ``name`` may join a step whose rows use ``running`` adapters now."""
        if name not in running and len(running) >= self.per_step:
            return False
        return self.want(name)

    def loaded(self, name: str) -> None:
        self.residency.loaded(name)

    def factor(self, running: set[str]) -> float:
        return self.costs.step_factor(self.shapes[n].rank if n in self.shapes else self.costs.default_rank
                                      for n in running)

    def state(self) -> AdapterState:
        r = self.residency
        return AdapterState(r.capacity, r.names(), tuple(sorted(r.loading)), r.loads, r.evictions)
