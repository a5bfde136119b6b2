"""sim-lm, the simulated generative device: its engine's arithmetic with an injected clock, then the whole
pipeline with real processes and the official `openai` client."""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpu_worker.backends.generation import Row
from gpu_worker.backends.interface import Hooks, ItemError
from gpu_worker.backends.registry import load_backend
from gpu_worker.backends.sim_lm import SimLMBackend
from gpu_worker.backends.sim_lm_engine import (
    A100_80GB_BYTES,
    DEFAULT_KV_TOKENS,
    LLAMA2_7B,
    Engine,
    KVCache,
    Seq,
    Step,
    Timing,
    kv_capacity,
    page_keys,
    run_static,
    static_groups,
    static_time_ms,
)
from gpu_worker.backends.sim_lm_text import GREEDY, SimTokenizer, Text
from tasks.config import Settings
from tasks.policy.prefixes import prefix_keys
from tasks.schema import GenerationOutput, SamplingParams
from tests.fakes import FakeClock
from tests.outputs import generated


def greedy(max_tokens: int, stop: tuple[str, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop)


def make_seq(prompt: list[int], max_tokens: int, *, index: int = 0, eos: int | None = None, stop: tuple[str, ...] = (),
             text: str = "prompt", cancelled: Callable[[], bool] = lambda: False) -> Seq:
    return Seq(Row(index, prompt, max_tokens, list(stop)), Text(text, GREEDY), eos, cancelled=cancelled)


def drive(engine: Engine, *, limit: int = 1000) -> list[Step]:
    """Step until nothing is left; the steps."""
    steps: list[Step] = []
    while engine.busy and len(steps) < limit:
        steps.append(engine.step())
        assert engine.kv.used + len(engine.kv.cached) <= engine.kv.total
    return steps


@pytest.fixture
def backend() -> Iterator[SimLMBackend]:
    b = SimLMBackend(speed=1000)
    yield b
    b.close()


# -- defaults from the published figures ---------------------------------------------------------------------
def test_the_kv_budget_is_derived_from_the_model_shape_and_the_gpu() -> None:
    per_token = 2 * LLAMA2_7B["layers"] * LLAMA2_7B["hidden"] * 2
    assert per_token == 512 * 1024
    free = 0.9 * A100_80GB_BYTES - 2 * LLAMA2_7B["params"]
    assert DEFAULT_KV_TOKENS == int(free // per_token) // 16 * 16 == 121_744
    assert Settings().sim.lm_kv_tokens == DEFAULT_KV_TOKENS
    assert kv_capacity(A100_80GB_BYTES, LLAMA2_7B["params"], 32, 4096, page_size=1) == 121_750


def test_the_default_timing_reproduces_the_published_latencies() -> None:
    """NVIDIA's Llama-2-7B on an A100 80GB: 128 prompt and 20 output tokens per sequence."""
    published = {1: 234.0, 2: 249.6, 4: 272.6, 8: 329.5}
    for size, ms in published.items():
        assert static_time_ms([128] * size, [20] * size, Timing()) == pytest.approx(ms, rel=0.015)
    s = Settings()
    assert Timing(s.sim.lm_prefill_ms_per_token, s.sim.lm_step_ms, s.sim.lm_step_ms_per_seq) == Timing()
    assert 1000 / Timing().step(1) == pytest.approx(90, abs=1)  # tokens/s, one sequence
    assert 64 * 1000 / Timing().step(64) == pytest.approx(3600, rel=0.02)  # tokens/s at 64 sequences


# -- tokeniser and text -------------------------------------------------------------------------------------
def test_the_tokeniser_counts_words_and_pieces() -> None:
    tok = SimTokenizer()
    assert tok.pieces("the cat sat.") == ["the", " cat", " sat", "."]
    assert len(tok.encode("internationalization")) == 5  # long words: a token per 4 characters
    assert len(tok.encode("The quick brown fox jumps over the lazy dog.")) == 10
    assert tok.encode("hello world") == tok.encode("hello world") and tok.encode("a") != tok.encode("b")
    text = Text("x", GREEDY)
    ids = [text.token(k) for k in range(200)]
    assert len(tok(tok.decode(ids))["input_ids"]) == 200  # generated text re-tokenises to its own length


def test_greedy_text_ignores_the_seed_and_sampled_text_follows_it(backend: SimLMBackend) -> None:
    def text(prompt: str, **params: Any) -> str:
        return generated(backend.run([prompt], [SamplingParams(max_tokens=12, **params)]))[0].text

    greedy = text("hello", temperature=0, seed=1)
    assert greedy == text("hello", temperature=0, seed=2) == text("hello", temperature=0)
    assert greedy != text("hullo", temperature=0)
    assert text("hello", temperature=0.8, seed=7) == text("hello", temperature=0.8, seed=7)
    assert text("hello", temperature=0.8, seed=7) != text("hello", temperature=0.8, seed=8)
    assert len({text("hello", temperature=0.8) for _ in range(4)}) > 1  # no seed: fresh samples each time


def test_greedy_text_is_the_same_alone_or_batched(backend: SimLMBackend) -> None:
    prompts = [f"the queue {i} is fast" for i in range(12)]
    params = [greedy(4 + 3 * (i % 4)) for i in range(12)]
    alone = [backend.run([p], [q])[0] for p, q in zip(prompts, params)]
    assert backend.run(prompts, params) == alone
    with ThreadPoolExecutor(max_workers=4) as pool:  # four batches sharing the decode batch
        together = list(pool.map(lambda i: backend.run(prompts[i::4], params[i::4]), range(4)))
    assert [together[i % 4][i // 4] for i in range(12)] == alone
    static = SimLMBackend(mode="static", speed=1000)
    assert static.run(prompts, params) == alone


# -- lengths, stop sequences, errors -------------------------------------------------------------------------
def test_max_tokens_and_eos_give_mixed_lengths() -> None:
    no_eos = SimLMBackend(speed=1000, eos_mean=0)
    eos = SimLMBackend(speed=1000, eos_mean=16)
    try:
        prompts = [f"prompt {i}" for i in range(40)]
        params = [greedy(40)] * 40
        full = generated(no_eos.run(prompts, params))
        assert {o.completion_tokens for o in full} == {40} and {o.finish_reason for o in full} == {"length"}
        mixed = generated(eos.run(prompts, params))
        lengths = [o.completion_tokens for o in mixed]
        assert len(set(lengths)) > 10 and min(lengths) >= 1 and max(lengths) <= 40
        for o, whole, p in zip(mixed, full, prompts):  # EOS at the position drawn from the prompt's hash
            eos_at = Text(p, GREEDY).eos(16)
            assert o.finish_reason == ("stop" if eos_at is not None and eos_at < 40 else "length")
            assert whole.text.startswith(o.text)  # the same text, ended earlier
        assert sum(lengths) / len(lengths) == pytest.approx(16, rel=0.5)
    finally:
        no_eos.close()
        eos.close()


def test_stop_sequences_cut_the_text_and_are_never_streamed(backend: SimLMBackend) -> None:
    whole = generated(backend.run(["stop here"], [greedy(30)]))[0].text
    stop = whole.split(" ")[6]  # a word the model is going to say
    cut = whole[:whole.index(stop)]
    streamed: list[str] = []
    out = generated(backend.run(["stop here"], [greedy(30, stop=(stop, "zzzz"))],
                                Hooks(streaming={0}, stream=lambda deltas: streamed.extend(t for _, t in deltas))))[0]
    assert out.text == cut and out.finish_reason == "stop"
    assert out.completion_tokens == len(SimTokenizer().encode(cut))
    assert stop not in "".join(streamed) and out.text.startswith("".join(streamed))


def test_streamed_deltas_add_up_to_the_text(backend: SimLMBackend) -> None:
    calls: list[list[tuple[int, str]]] = []
    out = generated(backend.run(["a", "b"], [greedy(10)] * 2, Hooks(streaming={1}, stream=calls.append)))
    assert {p for call in calls for p, _ in call} == {1}  # only the row that asked for it
    assert "".join(t for call in calls for _, t in call) == out[1].text


def test_requests_the_model_cannot_take_are_item_errors(backend: SimLMBackend) -> None:
    small = SimLMBackend(speed=1000, kv_tokens=64, page_size=16, max_context=4096)
    try:
        out = small.run(["fits", "word " * 60, "x"], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8),
                                                      SamplingParams(max_tokens=100)])
        assert isinstance(out[0], GenerationOutput)
        assert isinstance(out[1], ItemError) and "KV cache" in out[1].message
        assert isinstance(out[2], ItemError)
    finally:
        small.close()
    out = backend.run(["word " * 4090, "not json"], [SamplingParams(max_tokens=16), SamplingParams(chat=True)])
    assert isinstance(out[0], ItemError) and "context of 4096" in out[0].message
    assert isinstance(out[1], ItemError) and "cannot build the prompt" in out[1].message
    chat = generated(backend.run(['[{"role": "user", "content": "hi"}]'], [SamplingParams(chat=True, max_tokens=4)]))[0]
    assert chat.prompt_tokens == len(SimTokenizer().encode("<|user|>hi\n<|assistant|>"))


# -- the paged KV cache, admission, retirement ---------------------------------------------------------------
def test_a_sequence_holds_a_page_per_page_size_tokens_of_prompt_and_output() -> None:
    engine = Engine(Timing(), KVCache(64, 4), max_seqs=8)
    seq = make_seq(list(range(10)), 5)
    engine.add(seq)
    held = []
    while engine.busy:
        engine.step()
        held.append(engine.kv.used)
    assert held == [3, 3, 4, 4, 0]  # ceil((10 + generated) / 4), then freed when it retires
    assert len(seq.tokens) == 5


def test_prompts_sharing_whole_pages_hold_and_prefill_them_once() -> None:
    common = list(range(100, 108))  # two whole pages of 4

    def first_step(sharing: bool) -> tuple[int, int]:
        engine = Engine(Timing(), KVCache(64, 4, sharing=sharing), max_seqs=8)
        engine.add(make_seq([*common, 1, 2], 4, index=0))
        engine.add(make_seq([*common, 3], 4, index=1))
        engine.add(make_seq([9, *common], 4, index=2))  # the same tokens, not at the start: nothing shared
        step = engine.step()
        return engine.kv.used, step.prefill_tokens

    assert first_step(sharing=False) == (3 + 3 + 3, 10 + 9 + 9)
    assert first_step(sharing=True) == (2 + 1 + 1 + 3, 10 + 1 + 9)
    engine = Engine(Timing(), KVCache(64, 4), max_seqs=8)
    a, b = make_seq([*common, 1], 2, index=0), make_seq([*common, 2], 6, index=1)
    engine.add(a)
    engine.add(b)
    drive(engine, limit=2)
    assert a.done and engine.kv.holders and engine.kv.used == 2 + 1  # b still holds the shared pages
    drive(engine)
    assert engine.kv.used == 0 and not engine.kv.holders


def test_a_prompts_pages_stay_cached_after_it_ends_and_a_later_prompt_skips_their_prefill() -> None:
    engine = Engine(Timing(), KVCache(64, 4), max_seqs=8)  # 16 pages
    system = list(range(100, 112))  # three whole pages: a tenant's system prompt
    engine.add(make_seq([*system, 1, 2], 2))
    first = drive(engine)
    assert first[0].prefill_tokens == 14
    assert engine.kv.used == 0 and engine.kv.blocks() == 3  # nobody holds them; they stay, by key
    engine.add(make_seq([*system, 7], 2, index=1))  # the same start, a new question
    again = drive(engine)
    assert again[0].prefill_tokens == 1  # only what follows the cached pages
    assert (engine.kv.queried, engine.kv.hits) == (3 + 3, 3)
    other = Engine(Timing(), KVCache(64, 4, sharing=False), max_seqs=8)  # without sharing, nothing is kept
    other.add(make_seq([*system, 1, 2], 2))
    drive(other)
    other.add(make_seq([*system, 7], 2, index=1))
    assert drive(other)[0].prefill_tokens == 13 and other.kv.blocks() == 0


def test_cached_pages_are_free_room_given_up_least_recently_used_first() -> None:
    a, b = list(range(100, 108)), list(range(200, 208))  # two prefixes of two whole pages each
    big = list(range(300, 316))  # four whole pages: with its one output token it holds 5

    def after_big(pages: int) -> tuple[Engine, int]:
        """a, then b, then a again (b is now the least recently used), then the big one; then a's prefill."""
        engine = Engine(Timing(), KVCache(pages * 4, 4), max_seqs=8)
        for i, prompt in enumerate(([*a, 1], [*b, 1], [*a, 2])):
            engine.add(make_seq(prompt, 1, index=i))
            drive(engine)
        assert engine.kv.free == pages and engine.kv.blocks() == 4  # cached pages are free room
        engine.add(make_seq(big, 1, index=3))
        drive(engine)
        engine.add(make_seq([*a, 5], 1, index=4))
        return engine, engine.step().prefill_tokens

    roomy, prefill = after_big(7)  # 5 + 4 > 7: two cached pages go, b's
    assert prefill == 1 and not any(k in roomy.kv.cached for k in page_keys([*b, 1], 4))
    _, prefill = after_big(6)  # 5 + 4 > 6: three go, b's and then a's tail (a chain's tail goes before its head)
    assert prefill == 9 - 4


def test_the_cache_says_which_prefix_keys_of_the_prompts_it_admitted_it_holds() -> None:
    tokenizer = SimTokenizer()
    system = "Our travel policy, in full. " * 80  # 2,240 characters: four whole chunks of 512
    engine = Engine(Timing(), KVCache(2048, 16), max_seqs=8, tokenizer=tokenizer)  # 128 pages
    prompt = system + "May I fly?"
    seq = Seq(Row(0, tokenizer.encode(prompt), 1, []), Text(prompt, GREEDY), None,
              prefix=prefix_keys(prompt), input_chars=len(prompt))
    engine.add(seq)
    drive(engine)
    held = engine.kv.prefixes(100)
    assert held and set(held) <= set(seq.prefix)
    assert len(held) >= len(seq.prefix) - 1  # each key's pages, one page short: the last may miss
    assert held == list(seq.prefix[:len(held)])  # a prefix of the chain
    flood = Engine(Timing(), engine.kv, max_seqs=8, tokenizer=tokenizer)  # the same cache, then filled by others
    for i in range(3):
        other = [1000 + i * 100 + j for j in range(1000)]
        flood.add(Seq(Row(i + 1, other, 1, []), Text("x", GREEDY), None))
        drive(flood)
    assert engine.kv.prefixes(100) == []  # evicted: no longer said to be held


def test_admission_waits_for_pages_and_a_retired_sequence_makes_room_at_the_next_step() -> None:
    engine = Engine(Timing(), KVCache(32, 4), max_seqs=8)  # 8 pages; each sequence holds 2 all its life
    seqs = [make_seq([i] * 4, i + 1, index=i, text=str(i)) for i in range(5)]
    for s in seqs:
        engine.add(s)
    first = engine.step()
    assert first.admitted == 4 and [s.row.index for s in engine.waiting] == [4]  # 4 x 2 pages: full
    assert first.retired == 1 and engine.kv.free == 2  # the one with max_tokens 1 left, and freed its pages
    second = engine.step()
    assert second.admitted == 1 and second.running == 4 and seqs[4] in engine.running
    limited = Engine(Timing(), KVCache(1024, 4), max_seqs=3)
    for i in range(5):
        limited.add(make_seq([i] * 4, 5, index=i))
    assert limited.step().running == 3 and len(limited.waiting) == 2


def test_a_full_cache_preempts_the_newest_and_it_finishes_later_with_the_same_text() -> None:
    def run(kv_tokens: int) -> tuple[list[list[int]], int]:
        engine = Engine(Timing(), KVCache(kv_tokens, 4), max_seqs=8)
        seqs = [make_seq([i] * 4, 8, index=i, text=str(i)) for i in range(3)]
        for s in seqs:
            engine.add(s)
        steps = drive(engine)
        return [s.tokens for s in seqs], sum(s.preempted for s in steps)

    roomy, none = run(1024)
    tight, preempted = run(32)  # 8 pages: three sequences of 2 pages grow to 3
    assert none == 0 and preempted >= 1 and tight == roomy


def test_cancellation_frees_the_slot_and_the_pages_at_the_next_step() -> None:
    gone: set[int] = set()
    engine = Engine(Timing(), KVCache(64, 4), max_seqs=8)
    for i in range(2):
        def cancelled(i: int = i) -> bool:
            return i in gone

        engine.add(make_seq(list(range(i, i + 6)), 20, index=i, cancelled=cancelled))
    engine.step()
    assert engine.kv.used == 4 and len(engine.running) == 2
    gone.add(0)
    step = engine.step()
    assert [(e[0], e[1], e[2].finish_reason) for _, e in step.events if e[0] == "done"] == [("done", 0, "cancelled")]
    assert step.running == 1 and engine.kv.used == 2
    assert step.ms == pytest.approx(Timing().step(1))  # the next step is one sequence smaller


# -- static vs continuous timing -----------------------------------------------------------------------------
def test_static_batches_pay_for_their_longest_member_and_continuous_ones_do_not() -> None:
    timing = Timing(prefill_ms_per_token=1.0, step_ms=10.0, step_ms_per_seq=1.0)
    prompts, outputs = [3, 5], [2, 6]
    slept: list[float] = []
    group = [make_seq([7] * p, n, index=i, text=str(i)) for i, (p, n) in enumerate(zip(prompts, outputs))]
    run_static(group, timing, slept.append)
    assert slept == [10 + 2 + 2 * 5] + [12.0] * 5  # padded prefill, then every step at the batch's full size
    assert sum(slept) == static_time_ms(prompts, outputs, timing) == 82
    engine = Engine(timing, KVCache(1024, 4), max_seqs=8)
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        engine.add(make_seq([7] * p, n, index=i, text=str(i)))
    continuous = list(engine.waiting)
    steps = [s.ms for s in drive(engine)]
    assert steps == [10 + 2 + (3 + 5), 12, 11, 11, 11, 11]  # the short one leaves after its 2nd token
    assert [s.tokens for s in continuous] == [s.tokens for s in group]


def test_static_batches_are_split_to_fit_the_cache() -> None:
    seqs = [make_seq([1] * 10, 6, index=i) for i in range(5)]
    assert [len(g) for g in static_groups(seqs, kv_tokens=64, max_seqs=8)] == [4, 1]  # 4 x 16 tokens fit
    assert [len(g) for g in static_groups(seqs, kv_tokens=1024, max_seqs=2)] == [2, 2, 1]


def test_the_backend_sleeps_the_simulated_time_in_both_modes() -> None:
    timing = Timing(prefill_ms_per_token=1.0, step_ms=10.0, step_ms_per_seq=1.0)
    for mode, expected_ms in (("static", 82), ("continuous", 76)):
        clock = FakeClock(start=0.0)
        b = SimLMBackend(mode=mode, timing=timing, eos_mean=0, clock=clock, sleep=clock.sleep, speed=2)
        try:
            out = generated(b.run(["a b c", "a b c d e"], [greedy(n) for n in (2, 6)]))
            assert [o.completion_tokens for o in out] == [2, 6]
            assert clock.now == pytest.approx(expected_ms / 1000 / 2)  # speed 2: half the time
            assert b.slots == (4 if mode == "continuous" else 1) and b.kv_tokens == DEFAULT_KV_TOKENS
        finally:
            b.close()


def test_a_cancelled_row_stops_at_the_next_step_while_the_rest_go_on() -> None:
    gone: set[int] = set()
    seen: list[tuple[int, str]] = []

    def stream(deltas: list[tuple[int, str]]) -> None:
        seen.extend(deltas)
        if len(seen) >= 3:
            gone.add(0)

    for mode in ("continuous", "static"):  # 1000 tokens would take 1.2 s at speed 10
        b = SimLMBackend(mode=mode, speed=10, eos_mean=0)
        gone.clear()
        seen.clear()
        try:
            out = generated(b.run(["long", "short"], [greedy(1000), greedy(40)],
                                  Hooks(streaming={0}, stream=stream, cancelled=lambda p: p in gone)))
            assert out[0].finish_reason == "cancelled" and 3 <= out[0].completion_tokens < 40
            assert (out[1].completion_tokens, out[1].finish_reason) == (40, "length")
            assert b.kv_used() == 0 and b.running() == 0
        finally:
            b.close()


def test_the_module_is_torch_free_and_loads_by_name() -> None:
    code = ("import sys, gpu_worker.backends.sim_lm; "
            "print(' '.join(m for m in ('torch', 'transformers', 'celery', 'redis') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and done.stdout.split() == [], done.stderr
    b = load_backend("sim-lm", Settings.of(sim_lm_mode="static", sim_lm_speed=100), model="my-lm")
    assert (b.name, b.kind, b.slots, b.max_context) == ("my-lm", "causal", 1, 4096)
    with pytest.raises(ValueError, match="LLMB_SIM_LM_MODE"):
        load_backend("sim-lm", Settings.of(sim_lm_mode="fast"))
    with pytest.raises(ValueError, match="sim-lm"):
        load_backend("nope", Settings())


# -- end to end: API -> RabbitMQ -> batcher -> a sim-lm worker, with the official client ----------------------
MODEL = "sim-lm"
WORKER = "gpu0@test"


@pytest.fixture(scope="module")
def lm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from harness.stack import running_stack

    with running_stack(Path(tmp_path_factory.mktemp("sim-lm")), web_workers=1,
                       workers=[(0, {"backend": "sim-lm"})],  # real time: the modelled A100's 11 ms steps
                       heartbeat_interval_s=0.25, heartbeat_stale_factor=4,
                       stream_resume_ms=0) as s:  # a stream left is cancelled at once (the default window:
        yield s                                   # test_stream_resume.py, test_openai_api.py)


@pytest.fixture(scope="module")
def client(lm_stack: Any) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=lm_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local() -> Iterator[SimLMBackend]:
    """The same model in this process (fast): what the worker must answer."""
    b = SimLMBackend(speed=1000)
    yield b
    b.close()


def test_e2e_the_worker_serves_sim_lm_and_advertises_its_kv_budget(lm_stack: Any, client: Any) -> None:
    assert {m.id for m in client.models.list()} == {MODEL}
    beat = lm_stack.fleet()[WORKER]
    assert (beat["model"], beat["kind"], beat["slots"], beat["max_context"]) == (MODEL, "causal", 4, 4096)
    assert beat["kv_tokens"] == DEFAULT_KV_TOKENS


def test_e2e_completions_and_chat_with_usage(client: Any, local: SimLMBackend) -> None:
    r = client.completions.create(model=MODEL, prompt="the cat sat on the mat", max_tokens=5, temperature=0)
    want = generated(local.run(["the cat sat on the mat"], [greedy(5)]))[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, want.completion_tokens)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    from gpu_worker.backends.sim_lm import render_chat

    assert chat.usage.prompt_tokens == len(SimTokenizer().encode(render_chat(messages)))
    stopped = client.completions.create(model=MODEL, prompt="the cat sat on the mat", max_tokens=5, temperature=0,
                                        stop=[want.text.split(" ")[3]])
    assert stopped.choices[0].finish_reason == "stop" and want.text.startswith(stopped.choices[0].text)


def test_e2e_streams_add_up_to_the_whole_answer(client: Any) -> None:
    whole = client.completions.create(model=MODEL, prompt="the worker", max_tokens=12, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt="the worker", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text and len(pieces) >= 2
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


def test_e2e_greedy_outputs_do_not_depend_on_the_batch(client: Any) -> None:
    prompts = [f"the queue {i} is fast" for i in range(12)]

    def one(p: str) -> str:
        return str(client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text)

    alone = [one(p) for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == alone


def test_e2e_a_cancelled_stream_frees_its_slot(lm_stack: Any, client: Any) -> None:
    from harness.stack import wait_for

    # a prompt whose EOS is past 1000 tokens: left alone, it would stream for 1000 x 11.1 ms = 11 s
    prompt = next(p for p in (f"tell me a long story {i}" for i in range(100_000))
                  if (Text(p, GREEDY).eos(Settings().sim.lm_eos_mean) or 0) >= 1000)
    natural_s = 1000 * Timing().step(1) / 1000

    def beat() -> dict[str, Any]:
        return lm_stack.fleet()[WORKER]

    wait_for(lambda: beat()["state"] == "idle" and not beat()["outstanding"], 30, "the worker idle")
    before = beat()["completed"]
    started = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1000, temperature=0, stream=True)
    chunks = iter(stream)
    assert [next(chunks).choices[0].text for _ in range(3)]
    wait_for(lambda: beat()["state"] == "busy" and beat()["outstanding"] == 1, 5, "the worker busy with the stream")
    stream.close()  # the client leaves mid-stream
    wait_for(lambda: beat()["state"] == "idle" and not beat()["outstanding"] and beat()["completed"] > before,
             natural_s, "the worker to report its slot free again")
    assert time.monotonic() - started < natural_s / 2, "the generation ran on after its caller left"
    r = client.completions.create(model=MODEL, prompt="next", max_tokens=4, temperature=0, timeout=5)
    assert r.usage.completion_tokens >= 1
