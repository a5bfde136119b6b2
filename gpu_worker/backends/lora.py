"""LoRA adapters on a shared base model, rows of different adapters (and of none) in one forward pass.

The base layers run once for the whole batch; each targeted linear layer then adds, for the positions of each
adapter, its low-rank delta ``scale * (x @ A^T) @ B^T`` (the shape of Punica's SGMV and S-LoRA's gather, in plain
torch): a forward hook on the layer gathers those positions (``index_select``), runs the two small matmuls and
adds the result back in place (``index_add_``). Which positions belong to which adapter is a :class:`Gather`, set
for the thread that runs the forward pass (:class:`LoraHooks` keeps it thread-local, so the continuous engine's
own thread, a static ``generate()`` and a logprob scoring pass can run at once):

- continuous batching packs every request's tokens in one row ``[1, tokens]`` (prefill chunks and decode tokens
  side by side): the gather is over dimension 1, each request's ``query_length`` tokens taken by its adapter
  (:func:`packed_gather`, built from the step's requests in the order the engine packed them);
- a padded ``generate()`` has ``[rows, positions]``: the gather is over dimension 0, by row.

With several adapters in a pass and few tokens (decode steps), a loop over adapters costs launches, not arithmetic:
then the layer runs all of them at once, stacked (as Punica's SGMV does in one kernel): ``x @ A_cat^T`` for the
adapters' ``A`` concatenated (``[sum r, in]``), each position's columns other than its own adapter's zeroed by a
mask, then ``@ B_cat^T``. That is 4 operations per layer whatever the number of adapters, for ``S`` times the
(small) LoRA arithmetic; the stacks are built once per set of adapters and kept while that set recurs.

A layer whose forward runs without a gather (the base model, every worker that serves no adapter) adds nothing.
Transformers' continuous batching has no adapter support, and PEFT's ``adapter_names=`` indexes batch rows, not
packed tokens, hence this module. It reads a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``)
itself and refuses what it does not implement (DoRA, LoRA biases, ``modules_to_save``, embedding or output-head
LoRA, rank or alpha patterns) with an :class:`AdapterError`: its rows get an item error, never wrong numbers.
"""
from __future__ import annotations

import itertools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
HEAD_NAMES = ("lm_head", "embed_out", "output")  # output heads: continuous batching slices their input (refused)
_SERIAL = itertools.count(1)


class AdapterError(Exception):
    """An adapter this worker cannot serve (missing, malformed or using a LoRA feature not implemented here)."""


@dataclass(frozen=True)
class LoraWeights:
    """One layer's pair: ``a`` is ``[r, in]``, ``b`` is ``[out, r]`` with the adapter's scale folded in."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, eq=False)
class Adapter:
    """A loaded adapter: its layers' weights by the base model's module names, on the model's device and dtype."""

    name: str
    path: str
    layers: Mapping[str, LoraWeights]
    rank: int
    nbytes: int
    serial: int = 0  # distinct per load (a reloaded adapter's cached prompt blocks are not the old weights')


def targetable(model: nn.Module) -> dict[str, nn.Module]:
    """The base model's layers an adapter may target: its linear layers (and GPT-2's Conv1D), output head excluded."""
    from transformers.pytorch_utils import Conv1D

    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear | Conv1D) and name.split(".")[-1] not in HEAD_NAMES}


def _refusals(config: Mapping[str, Any]) -> list[str]:
    """What in an adapter's config this module does not implement (each would give wrong numbers if ignored)."""
    found = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        found.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases"), ("use_qalora", "QA-LoRA"),
                      ("use_bdlora", "BD-LoRA"), ("modules_to_save", "modules_to_save"),
                      ("trainable_token_indices", "trainable tokens"), ("layer_replication", "layer replication"),
                      ("rank_pattern", "a rank_pattern"), ("alpha_pattern", "an alpha_pattern"),
                      ("alora_invocation_tokens", "aLoRA"), ("target_parameters", "target_parameters")):
        if config.get(key):
            found.append(what)
    if str(config.get("bias", "none")) != "none":
        found.append(f"bias {config.get('bias')!r}")
    return found


def _module_name(key: str, part: str, modules: Mapping[str, nn.Module]) -> str:
    """The base model's module a weight key belongs to: PEFT saves ``base_model.model.<module>.lora_A.weight``."""
    name = key[:key.index(part)]
    name = name.removeprefix("base_model.model.")
    for candidate in (name, f"model.{name}", name.removeprefix("model.")):
        if candidate in modules:
            return candidate
    raise AdapterError(f"{key!r} names no linear layer of the base model that this worker adapts (embedding and "
                       "output-head LoRA are not supported)")


def _config(name: str, path: Path) -> float:
    """The adapter's scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), once its config is checked."""
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError as exc:
        raise AdapterError(f"no {CONFIG} in {str(path)!r}") from exc
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG} in {str(path)!r} is unreadable: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG} in {str(path)!r} is not a JSON object")
    if refused := _refusals(config):
        raise AdapterError(f"adapter {name!r} uses what this worker does not support: {', '.join(refused)}")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{CONFIG} in {str(path)!r} has no valid r and lora_alpha") from exc
    if r <= 0:
        raise AdapterError(f"{CONFIG} in {str(path)!r}: r must be positive")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pairs(name: str, path: Path, modules: Mapping[str, nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter's weights by base module: ``{"lora_A": ..., "lora_B": ...}`` each (on the CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path / WEIGHTS), device="cpu")
    except FileNotFoundError as exc:
        raise AdapterError(f"no {WEIGHTS} in {str(path)!r} (only safetensors weights are read)") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS} in {str(path)!r} is unreadable: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        part = next((p for p in (".lora_A.", ".lora_B.") if p in key), None)
        if part is None or not key.endswith(".weight"):
            raise AdapterError(f"adapter {name!r} has a weight this worker does not support: {key!r} "
                               "(only lora_A / lora_B of linear layers)")
        pairs.setdefault(_module_name(key, part, modules), {})[part[1:-1]] = tensor
    if not pairs:
        raise AdapterError(f"{WEIGHTS} in {str(path)!r} holds no LoRA weights")
    return pairs


def read_adapter(name: str, path: str, modules: Mapping[str, nn.Module], device: torch.device,
                 dtype: torch.dtype) -> Adapter:
    """Load a PEFT LoRA directory against the base model's ``modules`` (:func:`targetable`); AdapterError if it is
    missing, malformed, or uses what is refused (see the module's docstring)."""
    folder = Path(path)
    scale = _config(name, folder)
    layers, nbytes, rank = {}, 0, 0
    for module_name, pair in _pairs(name, folder, modules).items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {name!r}: {module_name} lacks its lora_A or lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        fan_in, fan_out = _features(modules[module_name])
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {name!r}: {module_name}'s LoRA shapes {tuple(a.shape)} and {tuple(b.shape)} "
                               f"do not fit the base layer ({fan_in} in, {fan_out} out)")
        a = a.to(device=device, dtype=dtype).contiguous()
        b = (b.to(torch.float32) * scale).to(device=device, dtype=dtype).contiguous()
        layers[module_name] = LoraWeights(a, b)
        nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        rank = max(rank, a.shape[0])
    return Adapter(name, path, layers, rank, nbytes, next(_SERIAL))


def _features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    # GPT-2's Conv1D: its weight is stored [in, out] (PEFT's fan_in_fan_out); its LoRA pair is shaped as a Linear's
    nx: Any = module.nx
    nf: Any = module.nf
    return int(nx), int(nf)


DENSE_FROM = 3  # adapters in a pass from which the stacked (masked) path runs, when ...
DENSE_TOKENS = 512  # ... the pass has at most this many positions (beyond, the wasted arithmetic dominates)
KEPT_STACKS = 4  # sets of adapters whose stacked weights are kept


@dataclass(frozen=True)
class Gather:
    """Which positions of a forward pass belong to which adapter: along ``dim`` (1: packed tokens, 0: padded rows),
    each adapter with the index of its positions (None: all of them); ``slots``, each position's adapter as its
    index in ``groups`` (-1: none), shaped to broadcast against ``[..., columns]`` (for the stacked path)."""

    dim: int
    groups: tuple[tuple[Adapter, torch.Tensor | None], ...]
    slots: torch.Tensor | None = None

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(adapter.serial for adapter, _ in self.groups)


def whole(adapter: Adapter) -> Gather:
    """Every position of the pass by one adapter (scoring one row's logprobs)."""
    return Gather(0, ((adapter, None),))


def by_position(adapters: Sequence[Adapter | None], dim: int, device: torch.device) -> Gather | None:
    """The gather for positions ``0..n-1`` along ``dim`` (None where no adapter: the base model's)."""
    index: dict[int, tuple[Adapter, list[int]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            index.setdefault(id(adapter), (adapter, []))[1].append(i)
    if not index:
        return None
    n = len(adapters)
    groups = tuple((a, None if len(ix) == n else torch.tensor(ix, dtype=torch.long, device=device))
                   for a, ix in index.values())
    slots = None
    if len(groups) >= DENSE_FROM:
        slot = {id(a): g for g, (a, _) in enumerate(groups)}
        shape = (1, n, 1) if dim == 1 else (n, 1, 1)
        slots = torch.tensor([-1 if a is None else slot[id(a)] for a in adapters], device=device).view(shape)
    return Gather(dim, groups, slots)


def packed_gather(requests: Sequence[Any], adapter_of: Mapping[str, Adapter], device: torch.device) -> Gather | None:
    """A continuous-batching step's gather: ``requests`` are the step's FutureRequestStates in packing order, each
    with ``query_length`` tokens (prefill chunk or one decode token); trailing padding tokens get none."""
    positions: list[Adapter | None] = []
    for future in requests:
        positions += [adapter_of.get(future.state.request_id)] * int(future.query_length)
    return by_position(positions, 1, device)


class LoraHooks:
    """Forward hooks on every targetable layer; each adds its adapters' deltas for the gather of the current thread
    (nothing when there is none). Registered when the first adapter loads (:meth:`activate`), so a worker that never
    serves one runs its model untouched. (Registering is one dictionary assignment per layer, atomic under the GIL;
    a forward pass running meanwhile copies the layer's hooks before calling them.)"""

    def __init__(self, model: nn.Module) -> None:
        self.modules = targetable(model)
        self._local = threading.local()
        # stacked weights by set of adapters (their serials) and layer: A_cat, B_cat, each column's group index
        self._stacks: OrderedDict[tuple[int, ...], dict[str, tuple[torch.Tensor, ...] | None]] = OrderedDict()
        self._stacks_lock = threading.Lock()
        self._handles: list[Any] = []

    def activate(self) -> None:
        """Hook every targetable layer (once)."""
        with self._stacks_lock:
            if not self._handles:
                self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()]

    def current(self) -> Gather | None:
        return getattr(self._local, "gather", None)

    def set(self, gather: Gather | None) -> None:
        self._local.gather = gather

    @contextmanager
    def using(self, gather: Gather | None) -> Iterator[None]:
        before = self.current()
        self.set(gather)
        try:
            yield
        finally:
            self.set(before)

    def _hook(self, name: str) -> Any:
        def add_deltas(module: nn.Module, inputs: tuple[torch.Tensor, ...],
                       output: torch.Tensor) -> torch.Tensor | None:
            gather = self.current()
            if gather is None:
                return None
            x = inputs[0]
            if gather.slots is not None and x.dim() == 3 and x.shape[gather.dim] == gather.slots.shape[gather.dim] \
                    and x.numel() // x.shape[-1] <= DENSE_TOKENS:
                stack = self._stack(name, gather)
                if stack is not None:
                    a_cat, b_cat, column_group = stack
                    mask = (gather.slots == column_group).to(x.dtype)  # [rows or 1, 1 or tokens, columns]
                    output.add_(((x @ a_cat.T) * mask) @ b_cat.T)
                return output
            for adapter, index in gather.groups:
                weights = adapter.layers.get(name)
                if weights is None:
                    continue
                if index is None:
                    output.add_((x @ weights.a.T) @ weights.b.T)
                else:
                    picked = x.index_select(gather.dim, index)
                    output.index_add_(gather.dim, index, (picked @ weights.a.T) @ weights.b.T)
            return output
        return add_deltas

    def _stack(self, name: str, gather: Gather) -> tuple[torch.Tensor, ...] | None:
        """The layer's weights of the gather's adapters, concatenated (None: none of them targets the layer)."""
        key = gather.key
        with self._stacks_lock:
            layers = self._stacks.get(key)
            if layers is None:
                layers = self._stacks[key] = {}
                while len(self._stacks) > KEPT_STACKS:
                    self._stacks.popitem(last=False)
            else:
                self._stacks.move_to_end(key)
            if name not in layers:
                pairs = [(g, adapter.layers[name]) for g, (adapter, _) in enumerate(gather.groups)
                         if name in adapter.layers]
                layers[name] = None if not pairs else (
                    torch.cat([w.a for _, w in pairs]), torch.cat([w.b for _, w in pairs], dim=1),
                    torch.cat([torch.full((w.a.shape[0],), g, device=w.a.device) for g, w in pairs]))
            return layers[name]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
