"""Continuous batching for causal LMs, on transformers' ContinuousBatchingManager (paged KV cache).

One long-lived manager per worker (building one is the expensive part, so it is never rebuilt per batch).
Several batches run at once (the worker's pool threads each hand theirs in), and their requests join and
leave the running decode batch at every step: a short answer leaves as soon as it is done, and a request
that arrives while others generate starts at the next step instead of waiting for the batch to drain.
The KV-cache budget (pages x page size) is the real limit on concurrency; the worker advertises it.

Every request runs here, sampled ones included: the manager decodes greedily, with per-request temperature and
top_p, and :class:`~gpu_worker.backends.seeded_sampling.SeededGumbel` turns a sampled row's argmax into a draw
keyed by its own seed, so a seeded request gives the same text alone or beside any others. Prompt blocks are
shared and kept after their request ends (transformers' ``allow_block_sharing``); :class:`BlockCounter`
counts the look-ups and hits for the worker's heartbeat, and says which prompt starts are cached.

A single router thread drains the manager's output queue and hands each update to the batch waiting for
it, so batches never steal each other's results.

Rows of LoRA adapters (:mod:`gpu_worker.backends.lora`) run in the same steps as the base model's: a row joins the
manager once its adapter is resident (its lease resolves, off this loop) and the step gate lets it in (at most
``LLMB_MAX_ADAPTERS_PER_BATCH`` distinct adapters among the rows in the manager); at every forward pass a
pre-hook on the model reads the step's requests in packing order and sets the token-to-adapter gather.
"""
from __future__ import annotations

import functools
import logging
import queue
import secrets
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from gpu_worker.backends.block_cache import BlockCounter
from gpu_worker.backends.generation import Row, StopText, completion
from gpu_worker.backends.grammar import Compiled, Grammars, RowGrammar, hf_tokenizer
from gpu_worker.backends.interface import Hooks, ItemError, Outputs, PrefixCache
from gpu_worker.backends.lora import Adapter, LoraHooks, packed_gather
from gpu_worker.backends.lora_blocks import AdapterBlocks
from gpu_worker.backends.lora_pool import Lease, StepGate
from gpu_worker.backends.row_logits import RowShaping, Shaping
from gpu_worker.backends.seeded_sampling import NO_NOISE, SeededGumbel

log = logging.getLogger("llmb.worker")


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    page_size: int = 32
    max_batch_tokens: int = 512
    max_requests: int = 64


class ContinuousEngine:
    def __init__(self, model: Any, tokenizer: Any, eos_ids: list[int], config: EngineConfig,
                 lora: LoraHooks | None = None, adapters_per_step: int = 4) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.config = config
        self.shaping = RowShaping(int(model.config.vocab_size))
        self.manager = _sampling_manager(model, tokenizer, eos_ids, config, self.shaping)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()  # not the routes' lock: building the first takes about a second
        self.lora = lora
        self.gate = StepGate(adapters_per_step)
        self._leases: dict[str, Lease] = {}  # rows of an adapter, from the lease to the row's end
        self._parked: dict[str, tuple[Row, RowGrammar | None]] = {}  # rows waiting at the gate
        # rows in the manager with an adapter (read by its thread); a row that ended stays until a step runs
        # without it (the manager may still run a step of a row cancelled meanwhile: its tokens keep their adapter)
        self._adapter_of: dict[str, Adapter] = {}
        self._ended: set[str] = set()
        self.salts = AdapterBlocks(self.manager, int(model.config.vocab_size), self._salt)
        self._hooks = [] if lora is None else [
            model.register_forward_pre_hook(self._step_begins, with_kwargs=True),
            model.register_forward_hook(self._step_ends, with_kwargs=True)]
        self.manager.start()
        self.blocks = BlockCounter(self.manager, config.page_size)
        self._routes: dict[str, queue.SimpleQueue[Any]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._route, name="cb-router", daemon=True).start()

    def _step_begins(self, model: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """Before a step's forward pass (the manager's thread): which packed tokens belong to which adapter. The
        step's requests are those the manager just packed, in order (steps run one after the other)."""
        if self.lora is None or kwargs.get("cu_seq_lens_q") is None:  # not a continuous-batching step
            return
        if not self._adapter_of:
            self.lora.set(None)
            return
        requests = self.manager.batch_processor.inputs_and_outputs.requests_in_batch
        self.lora.set(packed_gather(requests, self._adapter_of, kwargs["input_ids"].device))
        if self._ended:
            stepping = {future.state.request_id for future in requests}
            with self._lock:
                for rid in [r for r in self._ended if r not in stepping]:
                    self._ended.discard(rid)
                    self._adapter_of.pop(rid, None)

    def _salt(self, rid: str) -> int | None:
        adapter = self._adapter_of.get(rid)
        return None if adapter is None else adapter.serial

    def _step_ends(self, model: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.lora is not None and kwargs.get("cu_seq_lens_q") is not None:
            self.lora.set(None)

    @property
    def kv_tokens(self) -> int:
        return self.config.num_blocks * self.config.page_size

    def _route(self) -> None:
        # Until stop(): once the manager is stopped, get_result returns at once, and this loop would spin.
        while not self._stopped.is_set():
            try:
                result = self.manager.get_result(timeout=0.5)
            except Exception:  # the manager stopped: nothing more will come
                log.exception("continuous batching manager failed")
                return
            if result is None:
                continue
            with self._lock:
                inbox = self._routes.get(result.request_id)
            if inbox is not None:
                inbox.put(result)

    def prefix_cache(self) -> PrefixCache:
        return self.blocks.figures()

    def grammars(self) -> Grammars:
        """The grammars compiled for this model's tokenizer (its llguidance view is built on first use: ~1 s)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(hf_tokenizer(self.tokenizer))
            return self._grammars

    def _add(self, rid: str, row: Row, grammar: RowGrammar | None = None) -> None:
        """A row ready to run joins the manager (one of an adapter once the step gate lets it in)."""
        with self._lock:
            lease = self._leases.get(rid)
            if lease is None:
                admitted = [(rid, row, grammar)]
            else:
                self._parked[rid] = (row, grammar)
                admitted = [(r, *self._parked.pop(r)) for r in self.gate.offer(rid, lease.adapter.name)]
        for joining in admitted:
            self._join(*joining)

    def _join(self, rid: str, row: Row, grammar: RowGrammar | None) -> None:
        with self._lock:
            if rid not in self._routes:  # its batch ended meanwhile (its caller left)
                return
            if (lease := self._leases.get(rid)) is not None:
                self._adapter_of[rid] = lease.adapter
        if grammar is not None or row.shaped:
            self.shaping.add(rid, Shaping(row, grammar))
        self.blocks.admitted(row)
        self.salts.wrap()
        self.manager.add_request(row.prompt_ids, request_id=rid, max_new_tokens=row.max_tokens, streaming=True,
                                 **sampling(row))

    def _leased(self, rid: str, row: Row, inbox: queue.SimpleQueue[Any], made: Future[Lease | ItemError]) -> None:
        """A row's adapter is resident (or cannot be): it goes on to its grammar or the gate, or fails alone."""
        if made.cancelled():
            return
        outcome = made.result()
        with self._lock:
            if rid not in self._routes:
                return
            if isinstance(outcome, Lease):
                self._leases[rid] = outcome
        if isinstance(outcome, ItemError):
            inbox.put((rid, outcome))
        elif row.grammar is not None:
            self.grammars().compile(row.grammar).add_done_callback(
                functools.partial(self._constrain, rid, row, inbox=inbox))
        else:
            self._add(rid, row)

    def _left(self, rid: str) -> None:
        """A row ended (answered, cancelled or failed): its adapter's place in the gate and its lease go."""
        with self._lock:
            lease = self._leases.pop(rid, None)
            if rid in self._adapter_of:
                self._ended.add(rid)
            self._parked.pop(rid, None)
            admitted = [(r, *self._parked.pop(r)) for r in self.gate.ended(rid)] if lease is not None else []
        if lease is not None:
            lease.release()
        for joining in admitted:
            self._join(*joining)

    def _constrain(self, rid: str, row: Row, made: Future[Compiled], inbox: queue.SimpleQueue[Any]) -> None:
        """A compiled grammar's row joins the manager (off its loop: it never waits for a grammar); one that
        failed answers its row alone, and one whose caller went away meanwhile is dropped."""
        with self._lock:
            if rid not in self._routes:
                return
        try:
            grammar = self.grammars().row(made.result())
        except Exception as exc:  # the pool shut down, or the compiler failed unexpectedly
            grammar = ItemError("invalid_request", f"the grammar could not be compiled: {exc}")
        if isinstance(grammar, ItemError):
            inbox.put((rid, grammar))
        else:
            self._add(rid, row, grammar)

    def generate(self, rows: list[Row], outputs: Outputs, hooks: Hooks,
                 leases: Mapping[int, Future[Lease | ItemError]] | None = None) -> None:
        """Generation for ``rows``, greedy or sampled each by its own parameters; fills ``outputs`` at each row's
        index. A sampled row without a seed gets a random one. A row with a future in ``leases`` (by index) waits
        for its adapter; the engine releases each lease when its row ends."""
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        by_id: dict[str, Row] = {}
        for row in rows:
            rid = uuid.uuid4().hex
            with self._lock:
                self._routes[rid] = inbox
            by_id[rid] = row
            if leases and row.index in leases:
                leases[row.index].add_done_callback(functools.partial(self._leased, rid, row, inbox))
            elif row.grammar is None:
                self._add(rid, row)
            else:
                self.grammars().compile(row.grammar).add_done_callback(
                    functools.partial(self._constrain, rid, row, inbox=inbox))
        rules = {rid: StopText(row.stop) for rid, row in by_id.items()}
        pending = set(by_id)
        try:
            while pending:
                try:
                    result = inbox.get(timeout=0.2)
                except queue.Empty:
                    result = None
                for rid in [r for r in pending if hooks.cancelled(by_id[r].index)]:
                    with self._lock:
                        self._routes.pop(rid, None)  # a row still waiting for its grammar or adapter never joins
                    self.manager.cancel_request(rid)
                    self._finish(by_id[rid], [], outputs, "cancelled")
                    pending.discard(rid)
                    self._left(rid)
                if isinstance(result, tuple):  # a grammar or an adapter that failed: its row alone
                    rid, error = result
                    outputs[by_id[rid].index] = error
                    pending.discard(rid)
                    self._left(rid)
                    continue
                if result is None or result.request_id not in pending:
                    continue
                if self._update(result, by_id[result.request_id], rules[result.request_id], outputs, hooks):
                    pending.discard(result.request_id)
                    self._left(result.request_id)
        finally:
            with self._lock:
                for rid in by_id:
                    self._routes.pop(rid, None)
            for rid in by_id:
                self._left(rid)
                self.blocks.finished(rid)
                self.shaping.drop(rid)

    def _update(self, result: Any, row: Row, rule: StopText, outputs: Outputs, hooks: Hooks) -> bool:
        """Stream a row's new text; write its answer and say so when it is done."""
        shaping = self.shaping.rows.get(result.request_id)
        if shaping is not None and shaping.error:  # its grammar went over its limits while generating
            self.manager.cancel_request(result.request_id)
            outputs[row.index] = ItemError("invalid_request", "the grammar exceeded this worker's limits: "
                                           f"{shaping.error[:300]}")
            return True
        tokens = [t for t in result.generated_tokens if t not in self.eos_ids]
        delta = rule.feed(self.tokenizer.decode(tokens, skip_special_tokens=True))
        if delta and row.index in hooks.streaming:
            hooks.stream([(row.index, delta)])
        if not (result.is_finished() or rule.stopped):
            return False
        if rule.stopped and not result.is_finished():
            self.manager.cancel_request(result.request_id)
        ended_by_eos = len(tokens) < len(result.generated_tokens)
        self._finish(row, tokens, outputs, "stop" if ended_by_eos or rule.stopped else "length",
                     self.blocks.cached(result.request_id))
        return True

    def _finish(self, row: Row, tokens: list[int], outputs: Outputs, finish: str, cached: int = 0) -> None:
        output = completion(self.tokenizer, row, tokens, finish)
        outputs[row.index] = replace(output, cached_tokens=min(cached, len(row.prompt_ids))) if cached else output

    def stop(self) -> None:
        self._stopped.set()
        self.manager.stop(block=True, timeout=10)
        for hook in self._hooks:
            hook.remove()


def sampling(row: Row) -> dict[str, Any]:
    """The per-request ``logit_processor_kwargs`` of a row: greedy is temperature 1, top_p 1 and no noise."""
    if row.temperature <= 0:
        return {"temperature": 1.0, "top_p": 1.0, "seed": NO_NOISE}
    seed = secrets.randbits(63) if row.seed is None else row.seed % (1 << 64)
    return {"temperature": float(row.temperature), "top_p": float(row.top_p), "seed": seed}


def _sampling_manager(model: Any, tokenizer: Any, eos_ids: list[int], config: EngineConfig,
                      shaping: RowShaping) -> Any:
    """A manager that decodes greedily after each row's own logits (:class:`RowShaping`: grammar mask, penalties,
    bias), per-request temperature, top_p and :class:`SeededGumbel`.

    transformers builds a processor only for a setting away from its neutral value, so the configuration it is
    built from names a placeholder temperature and top_p (each request sets its own); sampling is then turned off
    (argmax: the noise does the drawing), the seeded processor goes last and the row shaping first, each with one
    more row of arguments. Steps run one after the other (no asynchronous batching, no CUDA graphs), so that a
    row's mask is built from every token it has chosen."""
    generation = GenerationConfig(do_sample=True, temperature=0.5, top_p=0.5, top_k=0, eos_token_id=eos_ids,
                                  pad_token_id=tokenizer.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=config.num_blocks, page_size=config.page_size,
                                  max_batch_tokens=config.max_batch_tokens, max_requests_per_batch=config.max_requests,
                                  per_request_processors=True, allow_block_sharing=True,
                                  use_async_batching=False, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
    manager.generation_config.do_sample = False
    processors = manager.logit_processor
    names = [type(p).__name__ for p in processors.logits_processor]
    if names != ["ContinuousBatchingTemperatureLogitsWarper", "ContinuousBatchingTopPLogitsWarper"]:
        raise RuntimeError(f"unexpected continuous-batching logits processors {names}: transformers changed")
    processors.logits_processor.append(SeededGumbel())
    processors.logits_processor.insert(0, shaping)
    processors.tensors_required += 2
    processors.supported_keys.update(SeededGumbel.supported_kwargs)
    return manager
