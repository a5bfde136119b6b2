"""A PEFT LoRA directory as tests and examples need one: ``adapter_config.json`` and a tiny
``adapter_model.safetensors`` of random low-rank factors (numpy: no torch, no PEFT), in the layout PEFT saves."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def write_lora(folder: Path, *, rank: int = 8, base: str = "sim-lm", hidden: int = 16, layers: int = 1,
               target_modules: Sequence[str] = ("q_proj", "v_proj"), seed: int = 0) -> Path:
    """A LoRA adapter of rank ``rank`` for a model of ``layers`` layers of width ``hidden``, at ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
              "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(target_modules), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for module in target_modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, hidden), dtype=np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((hidden, rank), dtype=np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
