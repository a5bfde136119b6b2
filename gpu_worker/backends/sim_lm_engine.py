"""The pure part of ``sim-lm``: a token-level model of a generative device, free of torch, threads and sleeps.

What it models (the backend, :mod:`gpu_worker.backends.sim_lm`, runs it against a real clock; the tokeniser and
the text are in :mod:`gpu_worker.backends.sim_lm_text`):

- a tokeniser: pieces of words, whitespace and punctuation (a word of up to 6 characters is one token, a
  longer one a token per 4 characters), so prompt token counts are plausible;
- text: token ``k`` of an answer is a pseudo-word drawn from a hash of (prompt, sampling key, k). The
  sampling key of a greedy request (temperature 0) is fixed, so its text does not depend on the seed or on
  the batch; a sampled one is keyed by (temperature, top_p, seed), or by fresh randomness without a seed;
- output length: the answer ends at an "EOS" position drawn from the same hash, geometrically distributed
  with mean ``eos_mean`` (a constant chance of EOS at every step), capped by ``max_tokens``: finish_reason
  "stop" when EOS came first, "length" otherwise. ``eos_mean`` 0 turns EOS off (every answer runs to its
  ``max_tokens``). The EOS position does not depend on ``max_tokens``, so a shorter budget gives a prefix;
- time: a decoding step costs ``step_ms + step_ms_per_seq * n`` for ``n`` sequences in it, plus
  ``prefill_ms_per_token`` for every prompt token processed in it (a sequence's first token comes out of the
  step that prefills it);
- memory: a paged KV cache of ``kv_tokens`` (pages of ``page_size`` tokens). A sequence holds
  ceil((prompt + generated) / page_size) pages; with prefix sharing, the whole prompt pages that several
  sequences have in common (the same tokens from the start) are held, and prefilled, once; and, as vLLM's
  automatic prefix caching, they stay cached once their last holder ends, until the room is needed (least
  recently used first), so a later prompt with the same start is not prefilled again (continuous mode).

Two ways to run a batch, as real servers do:

- :class:`Engine` (continuous, iteration-level): every :meth:`Engine.step` first retires cancelled
  sequences (freeing their pages), gives every running sequence room for its next token (preempting the
  newest ones, vLLM-style recompute, when the cache is full), admits waiting sequences first come first
  served while their pages fit and fewer than ``max_seqs`` run, then produces one token for each running
  sequence and retires the finished ones;
- :func:`run_static`: a batch holds the device until its longest member is done, padded: its prefill is
  batch size x longest prompt tokens, and each of its steps costs a step at the full batch size. A batch
  whose padded KV (batch size x (longest prompt + largest max_tokens)) does not fit runs as several.

Defaults: Llama-2-7B (32 layers, hidden size 4096, no grouped-query attention, 6,738,415,616 parameters)
in fp16 on one A100 80GB SXM4, from NVIDIA's published NeMo Framework inference figures (docs.nvidia.com,
NeMo Framework user guide, Performance > Llama, "Llama-2 Results, Inference Performance, Configuration 1:
Chatbot Conversation": 128 input and 20 output tokens, TP=1, TensorRT-LLM): average latency 234.0, 249.6,
272.6 and 329.5 ms at batch sizes 1, 2, 4 and 8. A straight line fits them within 1%: 220.4 ms + 13.64 ms
per sequence. With ``latency = prefill + 20 steps``:

- ``step_ms`` = 220.4 / 20 = 11.0 ms (reading 13.5 GB of weights at the A100's 2.04 TB/s takes 6.6 ms);
- ``prefill_ms_per_token`` = 0.09 ms: 2 x 6.74e9 FLOPs a token at about 48% of the A100's 312 TFLOP/s
  (bf16 dense), i.e. about 11,000 prompt tokens/s;
- ``step_ms_per_seq`` = (13.64 - 128 x 0.09) / 20 = 0.106 ms.

So one sequence decodes at 90 tokens/s and 64 at once at 3,600 tokens/s (17.8 ms a step); at the default
LLMB_DEVICE_PRICE_PER_HOUR of 2.0 that is 0.15 per million output tokens at full load, 6.2 at batch 1.
The same table's H100 80GB column (153.8 ms at batch 1, 199.2 at 8) fits step_ms 7.4 and 6.5 ms per
sequence: on an H100 use about step_ms 7.4, step_ms_per_seq 0.13, prefill_ms_per_token 0.03.

KV capacity: 2 (K and V) x 32 layers x 4096 x 2 bytes = 512 KiB a token; 90% of 80 GiB (vLLM's default
gpu_memory_utilization) less 13.5 GB of weights leaves 59.4 GiB: 121,744 tokens in 16-token pages
(:func:`kv_capacity`). Llama-2's context is 4096 tokens.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_worker.backends.generation import Row, StopText, completion
from gpu_worker.backends.grammar import RowGrammar
from gpu_worker.backends.interface import ItemError
from gpu_worker.backends.sim_lm_adapters import AdapterGate
from gpu_worker.backends.sim_lm_grammar import choose, close_after, in_string, shaped
from gpu_worker.backends.sim_lm_kv import KVCache, page_keys
from gpu_worker.backends.sim_lm_text import EOS, VOCAB, SimTokenizer, Text

# -- the published figures the defaults come from (see the module docstring) --------------------------------
LLAMA2_7B = {"layers": 32, "hidden": 4096, "params": 6_738_415_616, "context": 4096}
A100_80GB_BYTES = 80 * 2**30
GPU_MEMORY_UTILISATION = 0.9  # vLLM's default share of GPU memory for weights + KV cache


def kv_capacity(gpu_bytes: float, params: int, layers: int, hidden: int, *, dtype_bytes: int = 2,
                utilisation: float = GPU_MEMORY_UTILISATION, page_size: int = 16) -> int:
    """Tokens of fp16 KV cache left on a GPU once the weights are loaded, in whole pages."""
    per_token = 2 * layers * hidden * dtype_bytes
    free = gpu_bytes * utilisation - params * dtype_bytes
    return int(free // per_token) // page_size * page_size


DEFAULT_KV_TOKENS = kv_capacity(A100_80GB_BYTES, LLAMA2_7B["params"], LLAMA2_7B["layers"], LLAMA2_7B["hidden"])


@dataclass(frozen=True)
class Timing:
    prefill_ms_per_token: float = 0.09
    step_ms: float = 11.0
    step_ms_per_seq: float = 0.106

    def step(self, sequences: int, prefill_tokens: int = 0) -> float:
        """Milliseconds of one decoding step for ``sequences`` running, ``prefill_tokens`` prefilled in it."""
        return self.step_ms + self.step_ms_per_seq * sequences + self.prefill_ms_per_token * prefill_tokens


# -- sequences ----------------------------------------------------------------------------------------------
# ("delta", index, text), ("done", index, its GenerationOutput), ("failed", index, its ItemError: this row alone)
# or ("error", -1, exc): the simulator failed
Event = tuple[str, int, Any]


@dataclass(eq=False)
class Seq:
    """One request being generated: its row (position, prompt tokens, max_tokens, stop), its text and where
    it stands. ``cancelled()`` says its caller has gone."""

    row: Row
    text: Text
    eos_at: int | None
    streaming: bool = False
    cancelled: Callable[[], bool] = lambda: False
    sink: Callable[[Event], None] = lambda event: None
    page_keys: list[int] = field(default_factory=list)  # one per whole prompt page, chained (set by the engine)
    # the batcher's names of its input's start (tasks.policy.prefixes), and the input's length in characters
    prefix: tuple[str, ...] = ()
    input_chars: int = 0
    tokens: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)  # prompt page keys it holds
    private: int = 0  # pages of its own it holds
    done: bool = False
    grammar: RowGrammar | None = None  # what constrains its tokens (set once compiled, before it joins the batch)
    cached: int = 0  # prompt tokens the prefix cache held on its first admission
    calls_first: bool = False  # a chat offering tools whose last word is the user's: open with a tool call
    adapter: str | None = None  # its LoRA adapter (gpu_worker.backends.sim_lm_adapters): joins once resident
    adapter_path: str | None = None  # ... its directory (its rank and size), and whether it is pinned
    adapter_pinned: bool = False

    def __post_init__(self) -> None:
        self.rule = StopText(self.row.stop) if self.row.stop or self.streaming else None
        self._text = ""

    @property
    def prompt_len(self) -> int:
        return len(self.row.prompt_ids)

    @property
    def length(self) -> int:
        """Tokens whose KV this sequence holds: its prompt and what it generated."""
        return self.prompt_len + len(self.tokens)

    def advance(self, tokenizer: SimTokenizer) -> list[Event]:
        """One decoding step: the next token, or EOS; the events it gives (a delta to stream, the end).
        EOS costs its step, as on a real model, and is not part of the answer."""
        if self.grammar is not None:
            token = self._constrained()
            if self.grammar.error:  # over its limits while generating: this row fails alone
                self.done = True
                return [("failed", self.row.index, ItemError("invalid_request", "the grammar exceeded this "
                                                             f"worker's limits: {self.grammar.error[:300]}"))]
            if token == EOS:
                return [self.finish(tokenizer, "stop")]
        elif self.eos_at is not None and len(self.tokens) == self.eos_at:
            return [self.finish(tokenizer, "stop")]
        else:
            token = self.text.token(len(self.tokens))
            if self.row.shaped:
                token = shaped(token, self.text.draw(len(self.tokens)), self.tokens, self.row)
        self.tokens.append(token)
        self._text = self._text + VOCAB[token] if self.grammar is None and not self.row.shaped \
            else tokenizer.decode(self.tokens)
        events: list[Event] = []
        if self.rule is not None:
            delta = self.rule.feed(self._text)
            if delta and self.streaming:
                events.append(("delta", self.row.index, delta))
            if self.rule.stopped:
                return [*events, self.finish(tokenizer, "stop")]
        if len(self.tokens) >= self.row.max_tokens:
            events.append(self.finish(tokenizer, "length"))
        return events

    def _constrained(self) -> int:
        """The next token among those the grammar allows (EOS once it is complete), fed to the grammar."""
        assert self.grammar is not None
        position = len(self.tokens)
        token = choose(self.grammar, self.text.token(position), self.text.draw(position),
                       position >= close_after(self.row.max_tokens), in_string(self._text), first=position == 0,
                       call=self.calls_first)
        if token != EOS and not self.grammar.consume(token):
            return EOS  # cannot happen with a token of the mask; ends the row rather than the batch
        return token

    def finish(self, tokenizer: SimTokenizer, reason: str) -> Event:
        self.done = True
        output = completion(tokenizer, self.row, self.tokens, reason)
        return ("done", self.row.index, replace(output, cached_tokens=self.cached) if self.cached else output)


# -- continuous batching ------------------------------------------------------------------------------------
@dataclass
class Step:
    ms: float  # simulated duration (0: nothing ran)
    running: int  # sequences that produced a token
    prefill_tokens: int
    events: list[tuple[Seq, Event]]
    admitted: int = 0
    retired: int = 0  # finished or cancelled
    preempted: int = 0


class Engine:
    """Iteration-level scheduling of sequences under a KV budget; one :meth:`step` is one decoding step."""

    def __init__(self, timing: Timing, kv: KVCache, max_seqs: int, tokenizer: SimTokenizer | None = None,
                 adapters: AdapterGate | None = None) -> None:
        self.timing = timing
        self.adapters = adapters  # rows with a LoRA adapter join once it is resident, a few adapters a step
        self.kv = kv
        self.max_seqs = max_seqs
        self.tokenizer = tokenizer or SimTokenizer()
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []

    def fits(self, seq: Seq) -> bool:
        """Whether ``seq`` could run to its max_tokens here, alone."""
        return self.kv.pages(seq.prompt_len + seq.row.max_tokens) <= self.kv.total

    def add(self, seq: Seq) -> None:
        seq.page_keys = page_keys(seq.row.prompt_ids, self.kv.page_size)
        self.kv.remember(seq)
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> Step:
        out: list[tuple[Seq, Event]] = []
        retired = 0
        for seq in [s for s in (*self.running, *self.waiting) if s.cancelled()]:  # caller gone: free it now
            if seq in self.running:
                self._leave(seq)
            else:
                self.waiting.remove(seq)
            out.append((seq, seq.finish(self.tokenizer, "cancelled")))
            retired += 1
        # room for every running sequence's next token, oldest first, preempting the newest while the cache
        # is full (they wait again at the head of the queue and are prefilled anew, their tokens kept)
        preempted, i = 0, 0
        while i < len(self.running):
            seq = self.running[i]
            while self.kv.cost(seq, seq.length + 1) > self.kv.free and len(self.running) - 1 > i:
                self._preempt(self.running.pop())
                preempted += 1
            if self.kv.cost(seq, seq.length + 1) > self.kv.free:  # the newest itself
                self._preempt(self.running.pop(i))
                preempted += 1
                continue
            self.kv.hold(seq, seq.length + 1)
            i += 1
        admitted = prefill = 0
        passed: list[Seq] = []  # rows whose adapter is not resident, or one too many for this step: they wait
        while (not preempted and self.waiting and len(self.running) < self.max_seqs
               and self.kv.cost(self.waiting[0], self.waiting[0].length + 1) <= self.kv.free):
            seq = self.waiting.popleft()
            if seq.adapter is not None and self.adapters is not None:
                if not self.adapters.admits(seq.adapter, self.running_adapters()):
                    passed.append(seq)
                    continue
                self.adapters.residency.acquire(seq.adapter)
            found = self.kv.lookup(seq) * self.kv.page_size  # pages here: no prefill
            seq.cached = seq.cached or min(found, seq.prompt_len)
            prefill += max(1, seq.length - found)
            self.kv.hold(seq, seq.length + 1)
            self.running.append(seq)
            admitted += 1
        self.waiting.extendleft(reversed(passed))
        n = len(self.running)
        factor = self.adapters.factor(self.running_adapters()) if self.adapters is not None else 1.0
        for seq in list(self.running):
            events = seq.advance(self.tokenizer)
            out += [(seq, e) for e in events]
            if seq.done:
                self._leave(seq)
                retired += 1
        ms = self.timing.step(n, prefill) * factor if n else 0.0
        return Step(ms, n, prefill, out, admitted, retired, preempted)

    def running_adapters(self) -> set[str]:
        return {s.adapter for s in self.running if s.adapter is not None}

    def _leave(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Seq) -> None:
        """``seq`` stops running (done, cancelled or preempted): its pages and its hold on its adapter go."""
        self.kv.release(seq)
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.residency.release(seq.adapter)

    def _preempt(self, seq: Seq) -> None:
        self._release(seq)
        self.waiting.appendleft(seq)


# -- static batching ----------------------------------------------------------------------------------------
def static_groups(seqs: Sequence[Seq], kv_tokens: int, max_seqs: int) -> list[list[Seq]]:
    """Consecutive groups whose padded KV (size x (longest prompt + largest max_tokens)) fits the cache."""
    groups: list[list[Seq]] = []
    for seq in seqs:
        group = groups[-1] if groups else None
        if group is not None and len(group) < max_seqs:
            width = max(s.prompt_len + s.row.max_tokens for s in [*group, seq])
            if (len(group) + 1) * width <= kv_tokens:
                group.append(seq)
                continue
        groups.append([seq])
    return groups


def static_time_ms(prompt_lens: Sequence[int], output_lens: Sequence[int], timing: Timing) -> float:
    """A padded batch's time: prefill of size x longest prompt, then longest output steps at the full size."""
    size = len(prompt_lens)
    return (timing.prefill_ms_per_token * size * max(prompt_lens)
            + max(output_lens) * timing.step(size))


def run_static(group: Sequence[Seq], timing: Timing, sleep_ms: Callable[[float], None],
               tokenizer: SimTokenizer | None = None) -> None:
    """Run one padded batch to its end: every step lasts a step at the batch's full size (finished and
    cancelled rows are padding) until no row is left; each row's events go to its sink as they happen."""
    tokenizer = tokenizer or SimTokenizer()
    size = len(group)
    first = True
    while True:
        for seq in group:
            if not seq.done and seq.cancelled():
                seq.sink(seq.finish(tokenizer, "cancelled"))
        live = [s for s in group if not s.done]
        if not live:
            return
        prefill = size * max(s.prompt_len for s in group) if first else 0
        first = False
        sleep_ms(timing.step(size, prefill))
        for seq in live:
            for event in seq.advance(tokenizer):
                seq.sink(event)
