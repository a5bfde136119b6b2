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
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from gpu_worker.backends import Hooks, PrefixCache
from gpu_worker.backends.block_cache import BlockCounter
from gpu_worker.backends.generation import Row, StopText, completion
from gpu_worker.backends.seeded_sampling import NO_NOISE, SeededGumbel

log = logging.getLogger("llmb.worker")


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256
    page_size: int = 32
    max_batch_tokens: int = 512
    max_requests: int = 64


class ContinuousEngine:
    def __init__(self, model: Any, tokenizer: Any, eos_ids: list[int], config: EngineConfig) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.config = config
        self.manager = _sampling_manager(model, tokenizer, eos_ids, config)
        self.manager.start()
        self.blocks = BlockCounter(self.manager, config.page_size)
        self._routes: dict[str, queue.SimpleQueue[Any]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._route, name="cb-router", daemon=True).start()

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

    def generate(self, rows: list[Row], outputs: list[Any], hooks: Hooks) -> None:
        """Generation for ``rows``, greedy or sampled each by its own parameters; fills ``outputs`` at each row's
        index. A sampled row without a seed gets a random one."""
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        by_id: dict[str, Row] = {}
        for row in rows:
            rid = uuid.uuid4().hex
            with self._lock:
                self._routes[rid] = inbox
            by_id[rid] = row
            self.blocks.admitted(row)
            self.manager.add_request(row.prompt_ids, request_id=rid, max_new_tokens=row.max_tokens, streaming=True,
                                     **sampling(row))
        rules = {rid: StopText(row.stop) for rid, row in by_id.items()}
        pending = set(by_id)
        try:
            while pending:
                try:
                    result = inbox.get(timeout=0.2)
                except queue.Empty:
                    result = None
                for rid in [r for r in pending if hooks.cancelled(by_id[r].index)]:
                    self.manager.cancel_request(rid)
                    self._finish(by_id[rid], [], outputs, "cancelled")
                    pending.discard(rid)
                if result is None or result.request_id not in pending:
                    continue
                row = by_id[result.request_id]
                tokens = [t for t in result.generated_tokens if t not in self.eos_ids]
                rule = rules[result.request_id]
                delta = rule.feed(self.tokenizer.decode(tokens, skip_special_tokens=True))
                if delta and row.index in hooks.streaming:
                    hooks.stream([(row.index, delta)])
                if result.is_finished() or rule.stopped:
                    if rule.stopped and not result.is_finished():
                        self.manager.cancel_request(result.request_id)
                    ended_by_eos = len(tokens) < len(result.generated_tokens)
                    self._finish(row, tokens, outputs, "stop" if ended_by_eos or rule.stopped else "length")
                    pending.discard(result.request_id)
        finally:
            with self._lock:
                for rid in by_id:
                    self._routes.pop(rid, None)
            for rid in by_id:
                self.blocks.finished(rid)

    def _finish(self, row: Row, tokens: list[int], outputs: list[Any], finish: str) -> None:
        outputs[row.index] = completion(self.tokenizer, row, tokens, finish)

    def stop(self) -> None:
        self._stopped.set()
        self.manager.stop(block=True, timeout=10)


def sampling(row: Row) -> dict[str, Any]:
    """The per-request ``logit_processor_kwargs`` of a row: greedy is temperature 1, top_p 1 and no noise."""
    if row.temperature <= 0:
        return {"temperature": 1.0, "top_p": 1.0, "seed": NO_NOISE}
    seed = secrets.randbits(63) if row.seed is None else row.seed % (1 << 64)
    return {"temperature": float(row.temperature), "top_p": float(row.top_p), "seed": seed}


def _sampling_manager(model: Any, tokenizer: Any, eos_ids: list[int], config: EngineConfig) -> Any:
    """A manager that decodes greedily after per-request temperature, top_p and :class:`SeededGumbel`.

    transformers builds a processor only for a setting away from its neutral value, so the configuration it is
    built from names a placeholder temperature and top_p (each request sets its own); sampling is then turned off
    (argmax: the noise does the drawing) and the seeded processor goes last, with one more row of arguments."""
    generation = GenerationConfig(do_sample=True, temperature=0.5, top_p=0.5, top_k=0, eos_token_id=eos_ids,
                                  pad_token_id=tokenizer.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=config.num_blocks, page_size=config.page_size,
                                  max_batch_tokens=config.max_batch_tokens, max_requests_per_batch=config.max_requests,
                                  per_request_processors=True, allow_block_sharing=True)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
    manager.generation_config.do_sample = False
    processors = manager.logit_processor
    names = [type(p).__name__ for p in processors.logits_processor]
    if names != ["ContinuousBatchingTemperatureLogitsWarper", "ContinuousBatchingTopPLogitsWarper"]:
        raise RuntimeError(f"unexpected continuous-batching logits processors {names}: transformers changed")
    processors.logits_processor.append(SeededGumbel())
    processors.tensors_required += 1
    processors.supported_keys.update(SeededGumbel.supported_kwargs)
    return manager
