"""Text generation with any Hugging Face causal LM.

Every request goes to continuous batching (:mod:`gpu_worker.backends.continuous`), sampled ones with their own
seeds, unless the worker runs in static mode (``LLMB_HF_MODE=static``): then each batch is a left-padded,
batched ``generate()``.

Each item carries its own parameters (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, and
``chat`` when its input is a JSON list of chat messages for the model's chat template). In static mode, items
that decode alike (all greedy, or the same temperature, top_p and seed) run as one padded batch; a per-row stopping
criterion ends each row at its own ``max_tokens`` or stop sequence, so a short request does not wait for
a long one to be decided (the stop rule both engines share is in
:mod:`gpu_worker.backends.generation`). Greedy outputs are the same whether a request ran alone or in a batch of 100.
bf16 on a GPU, fp32 on the CPU.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from gpu_worker.backends import NO_PREFIX_CACHE, Hooks, ItemError, PrefixCache
from gpu_worker.backends.continuous import ContinuousEngine, EngineConfig
from gpu_worker.backends.generation import Entry, Row, StopText, completion, cut_at_stop, with_logprobs
from tasks.policy.prefixes import prefix_keys


class _PerRowStop(StoppingCriteria):
    """Ends each row at its own token budget or stop sequence, or when its caller has gone away
    (transformers accepts a per-row answer)."""

    def __init__(self, rows: list[Row], prompt_len: int, tokenizer: Any, hooks: Hooks) -> None:
        self.rows = rows
        self.prompt_len = prompt_len
        self.tokenizer = tokenizer
        self.hooks = hooks

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_len
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for r, row in enumerate(self.rows):
            if generated >= row.max_tokens or self.hooks.cancelled(row.index):
                done[r] = True
            elif row.stop:
                text = self.tokenizer.decode(input_ids[r, self.prompt_len:], skip_special_tokens=True)
                done[r] = cut_at_stop(text, row.stop)[1]
        return done  # type: ignore[return-value]


class _RowStreamer(BaseStreamer):
    """Streams each row's new text at every decoding step, holding back what could still become a stop
    sequence; the final text (sent with the result) is authoritative."""

    def __init__(self, rows: list[Row], tokenizer: Any, hooks: Hooks, eos_ids: list[int]) -> None:
        self.rows = rows
        self.tokenizer = tokenizer
        self.hooks = hooks
        self.eos_ids = eos_ids
        self.tokens: list[list[int]] = [[] for _ in rows]
        self.rules = [StopText(row.stop) for row in rows]
        self.ended = [False] * len(rows)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        deltas = []
        for r, token in enumerate(value.reshape(len(self.rows), -1)[:, -1].tolist()):
            row = self.rows[r]
            if self.ended[r] or row.index not in self.hooks.streaming:
                continue
            if token in self.eos_ids or len(self.tokens[r]) >= row.max_tokens:
                self.ended[r] = True
                continue
            self.tokens[r].append(token)
            delta = self.rules[r].feed(self.tokenizer.decode(self.tokens[r], skip_special_tokens=True))
            self.ended[r] = self.rules[r].stopped
            if delta:
                deltas.append((row.index, delta))
        if deltas:
            self.hooks.stream(deltas)

    def end(self) -> None:
        pass


class HFCausalBackend:
    kind = "causal"

    def __init__(self, name: str, path: str, device: str, max_batch: int, max_tokens_cap: int,
                 continuous: EngineConfig | None = None, slots: int = 4) -> None:
        self.name = name
        self.slots = slots if continuous else 1
        self.max_batch = max_batch
        self.max_tokens_cap = max_tokens_cap
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        attention = {"attn_implementation": "sdpa"} if continuous else {}
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **attention).to(self.device).eval()  # type: ignore[arg-type]
        config = self.model.config
        self.max_context = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.engine = ContinuousEngine(self.model, self.tokenizer, self.eos_ids, continuous) if continuous else None
        self.run(["warm-up"], [{"max_tokens": 2, "temperature": 0}])

    @property
    def kv_tokens(self) -> int:
        """The KV-cache budget of continuous batching (0 in static mode)."""
        return self.engine.kv_tokens if self.engine is not None else 0

    def prefix_cache(self) -> PrefixCache:
        """The continuous engine's shared prompt blocks (static batches keep none)."""
        return self.engine.prefix_cache() if self.engine is not None else NO_PREFIX_CACHE

    def close(self) -> None:
        """Stop the continuous-batching manager (its thread would otherwise keep the process alive)."""
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    # -- prompts -------------------------------------------------------------------------------------
    def prompt_text(self, text: str, params: Mapping[str, Any]) -> str:
        if not params.get("chat"):
            return text
        messages = json.loads(text)
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return str(rendered)
        # a model without a chat template: a plain transcript it can continue
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    # -- the batch -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, inputs: Sequence[str], params: Sequence[Mapping[str, Any]] | None = None,
            hooks: Hooks | None = None) -> list[Any]:
        params = params or [{} for _ in inputs]
        hooks = hooks or Hooks()
        outputs: list[Any] = [None] * len(inputs)
        groups: dict[tuple[Any, ...], list[Row]] = {}
        scored: dict[int, tuple[Row, str]] = {}  # rows asking for logprobs, and their prompts
        for i, (text, p) in enumerate(zip(inputs, params)):
            try:
                prompt = self.prompt_text(text, p)
                ids = self.tokenizer(prompt)["input_ids"]
            except (ValueError, KeyError, TypeError) as exc:
                outputs[i] = ItemError("invalid_request", f"cannot build the prompt: {exc}")
                continue
            row = Row.from_params(i, ids, p)
            row.prefix, row.input_chars = prefix_keys(text), len(text)
            if len(ids) + row.max_tokens > self.max_context:
                outputs[i] = ItemError("context_length_exceeded", f"the prompt has {len(ids)} tokens and "
                                       f"max_tokens is {row.max_tokens}: more than this model's context of "
                                       f"{self.max_context}")
                continue
            if row.scored:
                scored[i] = (row, prompt)
            if row.max_tokens == 0:  # scoring a given text (echo): nothing to generate
                outputs[i] = completion(self.tokenizer, row, [], "length")
                continue
            key = ("greedy",) if row.temperature <= 0 else ("sample", row.temperature, row.top_p, row.seed)
            groups.setdefault(key, []).append(row)
        if self.engine is not None:  # requests join and leave at every decoding step, whatever their sampling
            self.engine.generate([row for rows in groups.values() for row in rows], outputs, hooks)
            groups = {}
        for key, rows in groups.items():
            for start in range(0, len(rows), self.max_batch):
                self._generate(key, rows[start:start + self.max_batch], outputs, hooks)
        for i, (row, prompt) in scored.items():
            if isinstance(outputs[i], dict):
                outputs[i] = with_logprobs(outputs[i], row, prompt, self._score)
        return outputs

    def _score(self, ids: list[int], start: int, top: int) -> list[Entry]:
        """Log-probabilities of ``ids[start:]`` from one forward pass of the model over ``ids`` (alone: no
        padding, so the figures are those of a direct forward pass), with the ``top`` likeliest tokens at each
        position. They are the model's own distribution, before temperature or top_p (as vLLM gives them)."""
        logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        entries: list[Entry] = []
        for t in range(start, len(ids)):
            if t == 0:
                entries.append({"token": self.tokenizer.decode([ids[0]]), "logprob": None, "top": None})
                continue
            row = logprobs[t - 1]
            best = torch.topk(row, top) if top else None
            entries.append({"token": self.tokenizer.decode([ids[t]]), "logprob": float(row[ids[t]]),
                            "top": [] if best is None else [[self.tokenizer.decode([k]), float(v)] for v, k in
                                                            zip(best.values.tolist(), best.indices.tolist())]})
        return entries

    def _generate(self, key: tuple[Any, ...], rows: list[Row], outputs: list[Any], hooks: Hooks) -> None:
        width = max(len(r.prompt_ids) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows],
                                 device=self.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows],
                            device=self.device)
        sampling: dict[str, Any] = {"do_sample": False}
        if key[0] == "sample":
            _, temperature, top_p, seed = key
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p}
            if seed is not None:
                torch.manual_seed(int(seed))
        generated = self.model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in rows),
            pad_token_id=pad, eos_token_id=self.eos_ids, stopping_criteria=StoppingCriteriaList(
                [_PerRowStop(rows, width, self.tokenizer, hooks)]),
            streamer=_RowStreamer(rows, self.tokenizer, hooks, self.eos_ids) if hooks.streaming else None,
            **sampling)
        for r, row in enumerate(rows):
            tokens = generated[r, width:].tolist()[:row.max_tokens]
            finish = "length"
            for n, token in enumerate(tokens):
                if token in self.eos_ids:
                    tokens, finish = tokens[:n], "stop"
                    break
                if token == pad:  # the row was stopped (stop sequence, cancelled): generate() padded the rest
                    tokens = tokens[:n]
                    break
            outputs[row.index] = completion(self.tokenizer, row, tokens, finish)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if i is not None]
