"""``sim-lm``: a simulated generative device behind the backend interface, modelled token by token.

Torch-free; the timing, KV cache, text and length model are in :mod:`gpu_worker.backends.sim_lm_engine`
(with the published figures its defaults come from). This module runs it against a real clock: the device
sleeps each simulated step (divided by ``speed``, so tests can run it faster), streams each step's new text
through :class:`~gpu_worker.backends.interface.Hooks` as hf-causal does, and stops a row whose caller has gone at the
next step, freeing its place and its pages.

- continuous mode: one engine thread per worker steps every running sequence; the worker's ``slots`` batches
  (its pool threads) hand their rows in and wait for them, so requests join and leave the decode batch at
  every step, under the KV budget the worker advertises;
- static mode: one batch at a time holds the device until its longest row is done (``slots`` 1).

Each item may carry ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` and ``chat`` (its input is
then a JSON list of messages, rendered as ``<|role|>content`` lines and ``<|assistant|>``, with its ``tools``),
``grammar`` (the row joins the engine once it is compiled, and chooses among the tokens it allows:
:mod:`gpu_worker.backends.sim_lm_grammar`), and the penalties and logit bias (on its choice of token).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from gpu_worker.backends.chat import answers_tool, transcript
from gpu_worker.backends.generation import Row, completion, with_logprobs
from gpu_worker.backends.grammar import Compiled
from gpu_worker.backends.interface import (
    NO_ADAPTERS,
    AdapterState,
    Generated,
    Hooks,
    ItemError,
    Outputs,
    PrefixCache,
    in_order,
)
from gpu_worker.backends.prefix_chains import held_prefixes
from gpu_worker.backends.sim_lm_adapters import AdapterCosts, AdapterGate
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
from gpu_worker.backends.sim_lm_grammar import sim_grammars
from gpu_worker.backends.sim_lm_text import SimTokenizer, Text, piece, sampling_key, sim_logprobs
from tasks.policy.adapter_residency import AdapterResidency
from tasks.policy.prefixes import prefix_keys
from tasks.schema import NO_PARAMS, Entry, GenerationOutput, SamplingParams

log = logging.getLogger("llmb.worker")
REPORTED_KEYS = 2048  # prefix keys a heartbeat lists at most (the most recently admitted prompts' first)


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """sim-lm's chat template: a ``<|role|>content`` line a message (an assistant's tool calls in their text form,
    a ``<|tools|>`` line first when the call offers tools), then ``<|assistant|>``."""
    return transcript(messages, tools, "<|{role}|>{content}\n", "<|assistant|>")


class SimLMBackend:
    kind = "causal"

    def __init__(self, name: str = "sim-lm", *, mode: str = "continuous", timing: Timing | None = None,
                 kv_tokens: int = DEFAULT_KV_TOKENS, page_size: int = 16, prefix_sharing: bool = True,
                 max_seqs: int = 256, slots: int = 4, max_batch: int = 100,
                 max_context: int = LLAMA2_7B["context"], eos_mean: float = 128.0, speed: float = 1.0,
                 max_adapters: int = 0, adapters_per_step: int = 4, adapter_costs: AdapterCosts | None = None,
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
        # LoRA adapters (continuous mode): at most max_adapters resident, adapters_per_step in one step, each
        # loaded off the step loop (a timer of its own), costed as gpu_worker.backends.sim_lm_adapters fits them
        self.gate = AdapterGate(AdapterResidency(max_adapters, clock), max(1, adapters_per_step),
                                adapter_costs or AdapterCosts(), self._start_load) \
            if max_adapters > 0 and mode == "continuous" else None  # static mode serves no adapters
        self.engine = Engine(self.timing, self.cache, max_seqs, self.tokenizer, self.gate)
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

    def adapters(self) -> AdapterState:
        """Its LoRA adapters for the heartbeat: resident (most recently used first), loading, loads, evictions."""
        if self.gate is None:
            return NO_ADAPTERS
        with self._cond:
            return self.gate.state()

    def _start_load(self, name: str, ms: float) -> None:
        """Copy ``name`` to the device off the step loop: it is resident ``ms`` (simulated) later."""
        timer = threading.Timer(ms / 1000 / self.speed, self._loaded, args=(name,))
        timer.daemon = True
        timer.start()

    def _loaded(self, name: str) -> None:
        with self._cond:
            if self.gate is not None:
                self.gate.loaded(name)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- prompts -------------------------------------------------------------------------------------
    def prompt_text(self, text: str, params: SamplingParams) -> str:
        return render_chat(json.loads(text), params.tools) if params.chat else text

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _seq(self, index: int, text: str, params: SamplingParams, hooks: Hooks) -> Seq | ItemError:
        try:
            prompt = self.prompt_text(text, params)
        except (ValueError, KeyError, TypeError) as exc:
            return ItemError("invalid_request", f"cannot build the prompt: {exc}")
        if params.adapter and self.gate is None:
            return ItemError("invalid_request", f"this worker serves no LoRA adapters ({params.adapter!r})")
        row = Row.from_params(index, self.tokenizer.encode(prompt), params)
        if len(row.prompt_ids) + row.max_tokens > self.max_context:
            return ItemError("context_length_exceeded", f"the prompt has {len(row.prompt_ids)} tokens and "
                             f"max_tokens is {row.max_tokens}: more than this model's context of {self.max_context}")
        key = sampling_key(row.temperature, row.top_p, row.seed, lambda: os.urandom(16))
        generated = Text(prompt, key)
        seq = Seq(row, generated, generated.eos(self.eos_mean), streaming=index in hooks.streaming,
                  cancelled=lambda: hooks.cancelled(index), input_chars=len(text),
                  prefix=prefix_keys(text, cache_key=params.prompt_cache_key),
                  calls_first=bool(params.chat and params.tools) and not answers_tool(json.loads(text)),
                  adapter=params.adapter or None, adapter_path=params.adapter_path,
                  adapter_pinned=params.adapter_pinned)
        if not self.engine.fits(seq):
            return ItemError("invalid_request", f"the prompt has {len(row.prompt_ids)} tokens and max_tokens is "
                             f"{row.max_tokens}: more than this device's KV cache of {self.kv_tokens}")
        return seq

    # -- the batch -----------------------------------------------------------------------------------
    def run(self, inputs: Sequence[str], params: Sequence[SamplingParams] | None = None,
            hooks: Hooks | None = None) -> list[Generated]:
        if len(inputs) > self.max_batch:
            raise ValueError(f"batch of {len(inputs)} exceeds the simulated device's {self.max_batch}")
        params = params or [NO_PARAMS] * len(inputs)
        hooks = hooks or Hooks()
        outputs: Outputs = {}
        seqs: list[Seq] = []

        def finished(index: int, output: GenerationOutput) -> GenerationOutput:
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
            grammars = {s.row.index: g for s in seqs if (g := params[s.row.index].grammar) is not None}
            self._run_seqs(seqs, grammars, outputs, hooks, finished)
        return in_order(outputs, len(inputs))

    def _scored(self, output: GenerationOutput, row: Row, text: str, params: SamplingParams) -> GenerationOutput:
        """``output`` with the log-probabilities it asked for (:func:`sim_logprobs`: deterministic)."""
        prompt = self.prompt_text(text, params)
        pieces = self.tokenizer.pieces(prompt)

        def score(ids: list[int], start: int, top: int) -> list[Entry]:
            return sim_logprobs(pieces + [piece(i) for i in ids[len(pieces):]], start, top)

        return with_logprobs(output, row, prompt, score)

    def _run_seqs(self, seqs: list[Seq], grammars: Mapping[int, str], outputs: Outputs, hooks: Hooks,
                  finished: Callable[[int, GenerationOutput], GenerationOutput]) -> None:
        """Run ``seqs``; those with a grammar (``grammars``, by index) join once it is compiled, off the engine's
        loop: the batch never waits for a grammar, and one that fails answers its row alone."""
        inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        for seq in seqs:
            seq.sink = inbox.put
        free = [seq for seq in seqs if seq.row.index not in grammars]
        if self.mode == "static":
            for seq in seqs:
                if seq.row.index in grammars:
                    self._constrain(seq, sim_grammars().compile(grammars[seq.row.index]), then=free.append)
            threading.Thread(target=self._static, args=(free, inbox), name="sim-lm-static", daemon=True).start()
        else:
            self._admit(free)
            for seq in seqs:
                if seq.row.index in grammars:
                    sim_grammars().compile(grammars[seq.row.index]).add_done_callback(functools.partial(
                        self._constrain, seq, then=lambda s: self._admit([s])))
        self._collect(inbox, len(seqs), outputs, hooks, finished)

    def _admit(self, seqs: list[Seq]) -> None:
        with self._cond:
            for seq in seqs:
                if seq.adapter is not None and self.gate is not None:
                    self.gate.arrived(seq.adapter, seq.adapter_path, seq.adapter_pinned)
                self.engine.add(seq)
            self._cond.notify_all()

    def _constrain(self, seq: Seq, made: Future[Compiled], then: Callable[[Seq], None]) -> None:
        """Give ``seq`` its grammar's matcher and hand it on, or answer it with the grammar's error."""
        try:
            row = sim_grammars().row(made.result())
        except Exception as exc:  # the pool shut down, or the compiler failed unexpectedly
            row = ItemError("invalid_request", f"the grammar could not be compiled: {exc}")
        if isinstance(row, ItemError):
            seq.sink(("failed", seq.row.index, row))
            return
        seq.grammar = row
        then(seq)

    def _collect(self, inbox: queue.SimpleQueue[Event], pending: int, outputs: Outputs, hooks: Hooks,
                 finished: Callable[[int, GenerationOutput], GenerationOutput]) -> None:
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
                if kind == "failed":  # this row alone (its grammar did not compile)
                    outputs[index] = output
                    hooks.done(index, output)
                    pending -= 1
                if kind == "error":  # the simulator itself failed: the batch goes back, as on a model fault
                    raise RuntimeError(f"simulated device failed: {output}")
                if kind == "done":
                    outputs[index] = output = finished(index, output)
                    hooks.done(index, output)
                    pending -= 1

    def _static(self, seqs: list[Seq], inbox: queue.SimpleQueue[Event]) -> None:
        if not seqs:
            return
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
                    if self.gate is not None:
                        self.gate.residency.in_use.clear()
                    self.engine = Engine(self.timing, KVCache(self.kv_tokens, self.cache.page_size,
                                                              self.cache.sharing), self.max_seqs, self.tokenizer,
                                         self.gate)
                    self.cache = self.engine.kv
                    continue
                self.steps += 1
                if not step.running and not step.events:  # every row waits for its adapter's load (it wakes us)
                    self._cond.wait(0.05)
                    continue
            if step.ms:
                left = started + step.ms / 1000 / self.speed - self.clock()
                if left > 0:
                    self.sleep(left)
            for seq, event in step.events:
                seq.sink(event)
