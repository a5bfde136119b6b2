"""Continuous batching for causal LMs, on transformers' ContinuousBatchingManager (paged KV cache).

One long-lived manager per worker (building one is the expensive part, so it is never rebuilt per batch).
Several batches run at once (the worker's pool threads each hand theirs in), and their requests join and
leave the running decode batch at every step: a short answer leaves as soon as it is done, and a request
that arrives while others generate starts at the next step instead of waiting for the batch to drain.
The KV-cache budget (pages x page size) is the real limit on concurrency; the worker advertises it.

A single router thread drains the manager's output queue and hands each update to the batch waiting for
it, so batches never steal each other's results.
"""
from __future__ import annotations

import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

from gpu_worker.backends import Hooks
from gpu_worker.backends.generation import Row, StopText, completion

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
        generation = GenerationConfig(do_sample=False, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
        cb = ContinuousBatchingConfig(num_blocks=config.num_blocks, page_size=config.page_size,
                                      max_batch_tokens=config.max_batch_tokens,
                                      max_requests_per_batch=config.max_requests)
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
        self.manager.start()
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

    def generate(self, rows: list[Row], outputs: list[Any], hooks: Hooks) -> None:
        """Greedy generation for ``rows``; fills ``outputs`` at each row's index."""
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        by_id: dict[str, Row] = {}
        for row in rows:
            rid = uuid.uuid4().hex
            with self._lock:
                self._routes[rid] = inbox
            by_id[rid] = row
            self.manager.add_request(row.prompt_ids, request_id=rid, max_new_tokens=row.max_tokens, streaming=True)
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

    def _finish(self, row: Row, tokens: list[int], outputs: list[Any], finish: str) -> None:
        outputs[row.index] = completion(self.tokenizer, row, tokens, finish)

    def stop(self) -> None:
        self._stopped.set()
        self.manager.stop(block=True, timeout=10)
