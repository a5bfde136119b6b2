"""Text generation with any Hugging Face causal LM.

Every request goes to continuous batching (:mod:`gpu_worker.backends.continuous`), sampled ones with their own
seeds, unless the worker runs in static mode (``LLMB_HF_MODE=static``): then each batch is a left-padded,
batched ``generate()``.

Each item carries its own parameters (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, and
``chat`` when its input is a JSON list of chat messages for the model's chat template, with ``tools``; penalties
and logit bias; a ``grammar``, in continuous mode: :mod:`gpu_worker.backends.row_logits`). In static mode, items
that decode alike (all greedy, or the same temperature, top_p and seed) run as one padded batch; a per-row stopping
criterion ends each row at its own ``max_tokens`` or stop sequence, so a short request does not wait for
a long one to be decided (the stop rule both engines share is in
:mod:`gpu_worker.backends.generation`). Greedy outputs are the same whether a request ran alone or in a batch of 100.
bf16 on a GPU, fp32 on the CPU.

A worker with ``LLMB_MAX_ADAPTERS`` > 0 serves LoRA adapters of its model (``params.adapter``): rows of different
adapters and of none share each forward pass (:mod:`gpu_worker.backends.lora`), adapters are loaded off the decoding
loop and kept resident by :class:`~gpu_worker.backends.lora_pool.AdapterPool`; in static mode a batch runs in waves
of at most ``LLMB_MAX_ADAPTERS_PER_BATCH`` adapters (and no more than the free slots), each a padded ``generate()``.
"""
from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from gpu_worker.backends.chat import for_template, transcript
from gpu_worker.backends.continuous import ContinuousEngine, EngineConfig
from gpu_worker.backends.generation import Row, StopText, completion, cut_at_stop, with_logprobs
from gpu_worker.backends.interface import (
    NO_ADAPTERS,
    NO_PREFIX_CACHE,
    AdapterState,
    Generated,
    Hooks,
    ItemError,
    Outputs,
    PrefixCache,
    in_order,
)
from gpu_worker.backends.lora import Adapter, LoraHooks, by_position, read_adapter, whole
from gpu_worker.backends.lora_pool import AdapterPool, Lease, give_up
from gpu_worker.backends.row_logits import Shaping, additive
from tasks.policy.prefixes import prefix_keys
from tasks.schema import NO_PARAMS, Entry, GenerationOutput, SamplingParams


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


class _RowShaping(LogitsProcessor):
    """OpenAI's penalties and logit bias on each row of a padded ``generate()`` (rows without them pass)."""

    def __init__(self, rows: list[Row], prompt_len: int) -> None:
        self.shapings = [Shaping(row, None) if row.shaped else None for row in rows]
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for r, shaping in enumerate(self.shapings):
            if shaping is not None:
                generated = input_ids[r, self.prompt_len:].tolist()
                scores[r] += additive(shaping, generated, scores.shape[-1]).to(scores.device, scores.dtype)
        return scores


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
                 continuous: EngineConfig | None = None, slots: int = 4, max_adapters: int = 0,
                 adapters_per_step: int = 4) -> None:
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
        _one_forward_at_a_time(self.model)
        config = self.model.config
        self.max_context = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        # LoRA: hooks on the model's linear layers once an adapter loads (they add nothing without a gather)
        self.lora = LoraHooks(self.model) if max_adapters > 0 else None
        self.pool = AdapterPool(max_adapters, self._read_adapter) if self.lora is not None else None
        self.adapters_per_step = max(1, adapters_per_step)
        self.engine = ContinuousEngine(self.model, self.tokenizer, self.eos_ids, continuous, self.lora,
                                       self.adapters_per_step) if continuous else None
        self.run(["warm-up"], [SamplingParams(max_tokens=2, temperature=0)])

    @property
    def kv_tokens(self) -> int:
        """The KV-cache budget of continuous batching (0 in static mode)."""
        return self.engine.kv_tokens if self.engine is not None else 0

    def prefix_cache(self) -> PrefixCache:
        """The continuous engine's shared prompt blocks (static batches keep none)."""
        return self.engine.prefix_cache() if self.engine is not None else NO_PREFIX_CACHE

    def adapters(self) -> AdapterState:
        """The LoRA adapters resident and loading, for the heartbeat."""
        return self.pool.state() if self.pool is not None else NO_ADAPTERS

    def _read_adapter(self, name: str, path: str) -> Adapter:
        assert self.lora is not None
        adapter = read_adapter(name, path, self.lora.modules, self.device, self.model.dtype)
        self.lora.activate()  # before any row of it runs
        return adapter

    def close(self) -> None:
        """Stop the continuous-batching manager (its thread would otherwise keep the process alive)."""
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        if self.pool is not None:
            self.pool.close()

    # -- prompts -------------------------------------------------------------------------------------
    def prompt_text(self, text: str, params: SamplingParams) -> str:
        if not params.chat:
            return text
        messages = json.loads(text)
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(for_template(messages), add_generation_prompt=True,
                                                          tokenize=False, tools=list(params.tools) or None)
            return str(rendered)
        # a model without a chat template: a plain transcript it can continue
        return transcript(messages, params.tools, "{role}: {content}\n", "assistant:")

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    # -- the batch -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, inputs: Sequence[str], params: Sequence[SamplingParams] | None = None,
            hooks: Hooks | None = None) -> list[Generated]:
        params = params or [NO_PARAMS] * len(inputs)
        hooks = hooks or Hooks()
        outputs: Outputs = {}
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
            row.prefix, row.input_chars = prefix_keys(text, cache_key=p.prompt_cache_key), len(text)
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
            if row.grammar is not None and self.engine is None:
                outputs[i] = ItemError("invalid_request", "this worker runs hf-causal in static mode "
                                       "(LLMB_HF_MODE=static), which does not constrain output to a grammar")
                continue
            key = ("greedy",) if row.temperature <= 0 else ("sample", row.temperature, row.top_p, row.seed)
            groups.setdefault(key, []).append(row)
        adapters: dict[int, Adapter] = {}  # the adapter each row ran with, for its logprobs
        leases: dict[int, Future[Lease | ItemError]] = {}
        try:
            if self.engine is not None:  # requests join and leave at every decoding step, whatever their sampling
                rows = [row for rows in groups.values() for row in rows]
                leases = self._lease(rows, params)
                self.engine.generate(rows, outputs, hooks, leases)
                adapters = {i: lease.result().adapter for i, lease in leases.items()  # type: ignore[union-attr]
                            if lease.done() and not lease.cancelled() and isinstance(lease.result(), Lease)}
                groups = {}
            for key, rows in groups.items():
                for wave in self._waves(rows):
                    adapters |= self._static_wave(key, wave, params, outputs, hooks)
            for row, prompt in scored.values():
                self._logprobs(row, prompt, params, outputs, adapters, leases)
        finally:
            give_up(list(leases.values()))
        return in_order(outputs, len(inputs))

    def _logprobs(self, row: Row, prompt: str, params: Sequence[SamplingParams], outputs: Outputs,
                  adapters: dict[int, Adapter], leases: dict[int, Future[Lease | ItemError]]) -> None:
        """A scored row's answer with its logprobs, from the model with the row's adapter."""
        i = row.index
        if row.adapter is not None and i not in adapters and isinstance(outputs[i], GenerationOutput):
            leases |= self._lease([row], params)  # a text scored with an adapter (echo, nothing generated)
            outcome = leases[i].result()
            if isinstance(outcome, ItemError):
                outputs[i] = outcome
                return
            adapters[i] = outcome.adapter
        if isinstance(done := outputs[i], GenerationOutput):
            outputs[i] = with_logprobs(done, row, prompt, functools.partial(self._score, adapter=adapters.get(i)))

    def _lease(self, rows: list[Row], params: Sequence[SamplingParams]) -> dict[int, Future[Lease | ItemError]]:
        """Ask for each adapter row's adapter (the pool loads it off the decoding loop)."""
        leases: dict[int, Future[Lease | ItemError]] = {}
        for row in rows:
            if row.adapter is not None:
                p = params[row.index]
                if self.pool is None:
                    leases[row.index] = _refused(row.adapter)
                else:
                    leases[row.index] = self.pool.request(row.adapter, p.adapter_path, p.adapter_pinned)
        return leases

    def _waves(self, rows: list[Row]) -> list[list[Row]]:
        """Static mode: padded batches of at most ``max_batch`` rows, each of all the rows of as many adapters as
        fit (the per-step cap, and the slots pinned adapters leave), first seen first; base rows in the first."""
        room = self.adapters_per_step
        if self.pool is not None:
            pinned = len(self.pool.residency.pinned & set(self.pool.residency.resident))
            room = max(1, min(room, self.pool.capacity - pinned))
        order = list(dict.fromkeys(row.adapter for row in rows if row.adapter is not None))
        sets = [set(order[i:i + room]) for i in range(0, len(order), room)] or [set()]
        waves = []
        for k, names in enumerate(sets):
            members = [row for row in rows if (row.adapter is None and k == 0) or row.adapter in names]
            waves += [members[i:i + self.max_batch] for i in range(0, len(members), self.max_batch)]
        return waves

    def _static_wave(self, key: tuple[Any, ...], rows: list[Row], params: Sequence[SamplingParams], outputs: Outputs,
                     hooks: Hooks) -> dict[int, Adapter]:
        """One padded ``generate()`` for ``rows``, their adapters leased for it (rows whose adapter fails: an item
        error each); the adapters the rows ran with."""
        by_name: dict[str, Future[Lease | ItemError]] = {}
        for row in rows:
            if row.adapter is not None and row.adapter not in by_name:
                by_name[row.adapter] = self._lease([row], params)[row.index]
        try:
            ready: dict[int, Adapter] = {}
            running = []
            for row in rows:
                outcome = by_name[row.adapter].result() if row.adapter is not None else None
                if isinstance(outcome, ItemError):
                    outputs[row.index] = outcome
                    continue
                if outcome is not None:
                    ready[row.index] = outcome.adapter
                running.append(row)
            if running:
                gather = None if self.lora is None or not ready else by_position(
                    [ready.get(row.index) for row in running], 0, self.device)
                if self.lora is None:
                    self._generate(key, running, outputs, hooks)
                else:
                    with self.lora.using(gather):
                        self._generate(key, running, outputs, hooks)
            return ready
        finally:
            give_up(list(by_name.values()))

    def _score(self, ids: list[int], start: int, top: int, adapter: Adapter | None = None) -> list[Entry]:
        """Log-probabilities of ``ids[start:]`` from one forward pass of the model over ``ids`` (alone: no
        padding, so the figures are those of a direct forward pass), with the ``top`` likeliest tokens at each
        position. They are the model's own distribution, before temperature or top_p (as vLLM gives them); a row
        of an adapter is scored with it."""
        if adapter is not None and self.lora is not None:
            with self.lora.using(whole(adapter)):
                return self._score(ids, start, top)
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

    def _generate(self, key: tuple[Any, ...], rows: list[Row], outputs: Outputs, hooks: Hooks) -> None:
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
            logits_processor=LogitsProcessorList([_RowShaping(rows, width)] if any(r.shaped for r in rows) else []),
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


def _one_forward_at_a_time(model: Any) -> None:
    """Serialise the model's forward passes: the continuous engine's steps (its thread), the logprob scoring passes
    (the batch threads) and static ``generate()``. A scoring pass run while a step ran gave wrong logprobs (3 batches
    of 4 scored rows at once: 24-59 of 60 rows off by up to 0.3, none with the lock); the passes share the device
    anyway."""
    forward = model.forward
    lock = threading.Lock()

    @functools.wraps(forward)
    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return forward(*args, **kwargs)

    model.forward = one_at_a_time


def _refused(adapter: str) -> Future[Lease | ItemError]:
    done: Future[Lease | ItemError] = Future()
    done.set_result(ItemError("invalid_request", f"this worker serves no LoRA adapters (LLMB_MAX_ADAPTERS=0), "
                                                 f"so not {adapter!r}"))
    return done


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if i is not None]
