"""``sim-lm``: a simulated generative device behind the backend interface, modelled token by token.

Torch-free; the timing, KV cache, text and length model are in :mod:`gpu_worker.backends.sim_lm_engine`
(with the published figures its defaults come from). This module runs it against a real clock: the device
sleeps each simulated step (divided by ``speed``, so tests can run it faster), streams each step's new text
through :class:`~gpu_worker.backends.Hooks` as hf-causal does, and stops a row whose caller has gone at the
next step, freeing its place and its pages.

- continuous mode: one engine thread per worker steps every running sequence; the worker's ``slots`` batches
  (its pool threads) hand their rows in and wait for them, so requests join and leave the decode batch at
  every step, under the KV budget the worker advertises;
- static mode: one batch at a time holds the device until its longest row is done (``slots`` 1).

Each item may carry ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` and ``chat`` (its input is
then a JSON list of messages, rendered as ``<|role|>content`` lines and ``<|assistant|>``).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpu_worker.backends import Hooks, ItemError, PrefixCache
from gpu_worker.backends.generation import Entry, Row, completion, with_logprobs
from gpu_worker.backends.prefix_chains import held_prefixes
from gpu_worker.backends.sim_lm_engine import (
    DEFAULT_KV_TOKENS,
    LLAMA2_7B,
    Engine,
    Event,
    KVCache,
    Seq,
    Timing,
    run_static,
    static_groups,
)
from gpu_worker.backends.sim_lm_text import VOCAB, SimTokenizer, Text, sampling_key, sim_logprobs
from tasks.policy.prefixes import prefix_keys

log = logging.getLogger("llmb.worker")
REPORTED_KEYS = 2048  # prefix keys a heartbeat lists at most (the most recently admitted prompts' first)


def render_chat(messages: Sequence[Mapping[str, str]]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


class SimLMBackend:
    kind = "causal"

    def __init__(self, name: str = "sim-lm", *, mode: str = "continuous", timing: Timing | None = None,
                 kv_tokens: int = DEFAULT_KV_TOKENS, page_size: int = 16, prefix_sharing: bool = True,
                 max_seqs: int = 256, slots: int = 4, max_batch: int = 100,
                 max_context: int = LLAMA2_7B["context"], eos_mean: float = 128.0, speed: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if mode not in ("continuous", "static"):
            raise ValueError(f"LLMB_SIM_LM_MODE must be 'continuous' or 'static', not {mode!r}")
        if speed <= 0:
            raise ValueError("LLMB_SIM_LM_SPEED must be positive")
        self.name = name
        self.mode = mode
        self.timing = timing or Timing()
        self.cache = KVCache(kv_tokens, page_size, prefix_sharing)
        self.max_seqs = max_seqs
        self.slots = slots if mode == "continuous" else 1
        self.max_batch = max_batch
        self.max_context = max_context
        self.eos_mean = eos_mean
        self.speed = speed
        self.clock = clock
        self.sleep = sleep
        self.tokenizer = SimTokenizer()
        self.engine = Engine(self.timing, self.cache, max_seqs, self.tokenizer)
        self.steps = 0  # decoding steps run (continuous mode)
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if mode == "continuous":
            self._thread = threading.Thread(target=self._loop, name="sim-lm-engine", daemon=True)
            self._thread.start()

    @property
    def kv_tokens(self) -> int:
        """The KV-cache budget, in tokens (what the worker advertises)."""
        return self.cache.tokens

    def kv_used(self) -> int:
        """Tokens' worth of pages held now."""
        with self._cond:
            return self.cache.used * self.cache.page_size

    def prefix_cache(self) -> PrefixCache:
        """Its prefix cache's figures since it started (continuous mode: static batches keep no cache)."""
        with self._cond:  # copied under the lock, the keys worked out outside it (a few ms for a full cache)
            caching = self.mode == "continuous" and self.cache.sharing
            queried, hits, blocks = self.cache.queried, self.cache.hits, self.cache.blocks()
            view = self.cache.prefix_view()
        return PrefixCache(caching, queried, hits, blocks, tuple(held_prefixes(*view, REPORTED_KEYS)))

    def running(self) -> int:
        """Sequences in the decode batch now, and waiting for it (continuous mode)."""
        with self._cond:
            return len(self.engine.running) + len(self.engine.waiting)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- prompts -------------------------------------------------------------------------------------
    def prompt_text(self, text: str, params: Mapping[str, Any]) -> str:
        return render_chat(json.loads(text)) if params.get("chat") else text

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _seq(self, index: int, text: str, params: Mapping[str, Any], hooks: Hooks) -> Seq | ItemError:
        try:
            prompt = self.prompt_text(text, params)
        except (ValueError, KeyError, TypeError) as exc:
            return ItemError("invalid_request", f"cannot build the prompt: {exc}")
        row = Row.from_params(index, self.tokenizer.encode(prompt), params)
        if len(row.prompt_ids) + row.max_tokens > self.max_context:
            return ItemError("context_length_exceeded", f"the prompt has {len(row.prompt_ids)} tokens and "
                             f"max_tokens is {row.max_tokens}: more than this model's context of {self.max_context}")
        temperature = float(params["temperature"]) if params.get("temperature") is not None else 1.0
        key = sampling_key(temperature, float(params.get("top_p") or 1.0), params.get("seed"),
                           lambda: os.urandom(16))
        generated = Text(prompt, key)
        seq = Seq(row, generated, generated.eos(self.eos_mean), streaming=index in hooks.streaming,
                  cancelled=lambda: hooks.cancelled(index), prefix=prefix_keys(text), input_chars=len(text))
        if not self.engine.fits(seq):
            return ItemError("invalid_request", f"the prompt has {len(row.prompt_ids)} tokens and max_tokens is "
                             f"{row.max_tokens}: more than this device's KV cache of {self.kv_tokens}")
        return seq

    # -- the batch -----------------------------------------------------------------------------------
    def run(self, inputs: Sequence[str], params: Sequence[Mapping[str, Any]] | None = None,
            hooks: Hooks | None = None) -> list[Any]:
        if len(inputs) > self.max_batch:
            raise ValueError(f"batch of {len(inputs)} exceeds the simulated device's {self.max_batch}")
        params = params or [{} for _ in inputs]
        hooks = hooks or Hooks()
        outputs: list[Any] = [None] * len(inputs)
        seqs: list[Seq] = []

        def finished(index: int, output: dict[str, Any]) -> dict[str, Any]:
            """A row's answer as written: with the log-probabilities it asked for (before its early write)."""
            row = seqs_by_index[index].row
            return self._scored(output, row, inputs[index], params[index]) if row.scored else output

        seqs_by_index: dict[int, Seq] = {}
        for i, (text, p) in enumerate(zip(inputs, params)):
            made = self._seq(i, text, p, hooks)
            if isinstance(made, ItemError):
                outputs[i] = made
                continue
            seqs_by_index[i] = made
            if made.row.max_tokens == 0:  # scoring a given text (echo): nothing to generate
                outputs[i] = finished(i, completion(self.tokenizer, made.row, [], "length"))
            else:
                seqs.append(made)
        if seqs:
            self._run_seqs(seqs, outputs, hooks, finished)
        return outputs

    def _scored(self, output: dict[str, Any], row: Row, text: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """``output`` with the log-probabilities it asked for (:func:`sim_logprobs`: deterministic)."""
        prompt = self.prompt_text(text, params)
        pieces = self.tokenizer.pieces(prompt)

        def score(ids: list[int], start: int, top: int) -> list[Entry]:
            return sim_logprobs(pieces + [VOCAB[i] for i in ids[len(pieces):]], start, top)

        return with_logprobs(output, row, prompt, score)

    def _run_seqs(self, seqs: list[Seq], outputs: list[Any], hooks: Hooks,
                  finished: Callable[[int, dict[str, Any]], dict[str, Any]]) -> None:
        inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        for seq in seqs:
            seq.sink = inbox.put
        if self.mode == "static":
            threading.Thread(target=self._static, args=(seqs, inbox), name="sim-lm-static", daemon=True).start()
        else:
            with self._cond:
                for seq in seqs:
                    self.engine.add(seq)
                self._cond.notify_all()
        self._collect(inbox, len(seqs), outputs, hooks, finished)

    def _collect(self, inbox: queue.SimpleQueue[Event], pending: int, outputs: list[Any], hooks: Hooks,
                 finished: Callable[[int, dict[str, Any]], dict[str, Any]]) -> None:
        """Hand each step's deltas to the stream and each finished row to ``outputs``, in this (the batch's)
        thread: publishing never holds up the device."""
        while pending:
            events = [inbox.get()]
            while True:
                try:
                    events.append(inbox.get_nowait())
                except queue.Empty:
                    break
            deltas = [(index, text) for kind, index, text in events if kind == "delta"]
            if deltas:
                hooks.stream(deltas)
            for kind, index, output in events:
                if kind == "error":  # the simulator itself failed: the batch goes back, as on a model fault
                    raise RuntimeError(f"simulated device failed: {output}")
                if kind == "done":
                    outputs[index] = output = finished(index, output)
                    hooks.done(index, output)
                    pending -= 1

    def _static(self, seqs: list[Seq], inbox: queue.SimpleQueue[Event]) -> None:
        try:
            for group in static_groups(seqs, self.kv_tokens, self.max_seqs):
                run_static(group, self.timing, self._sleep_ms, self.tokenizer)
        except Exception as exc:  # never leave the batch waiting
            log.exception("sim-lm static batch failed")
            inbox.put(("error", -1, exc))

    def _sleep_ms(self, ms: float) -> None:
        self.sleep(ms / 1000 / self.speed)

    # -- continuous batching -------------------------------------------------------------------------
    def _loop(self) -> None:
        """The engine thread: plan a step under the lock, sleep its simulated time (against the clock, so the
        bookkeeping does not add to it), then deliver its tokens."""
        while True:
            with self._cond:
                while not self._stopped and not self.engine.busy:
                    self._cond.wait()
                if self._stopped:
                    return
                started = self.clock()
                try:
                    step = self.engine.step()
                except Exception as exc:  # a defect of the simulator: fail what it holds, never hang its batches
                    log.exception("sim-lm engine step failed")
                    for seq in {*self.engine.running, *self.engine.waiting}:
                        seq.sink(("error", -1, exc))
                    self.engine = Engine(self.timing, KVCache(self.kv_tokens, self.cache.page_size,
                                                              self.cache.sharing), self.max_seqs, self.tokenizer)
                    self.cache = self.engine.kv
                    continue
                self.steps += 1
            if step.ms:
                left = started + step.ms / 1000 / self.speed - self.clock()
                if left > 0:
                    self.sleep(left)
            for seq, event in step.events:
                seq.sink(event)
