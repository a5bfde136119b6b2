"""Seeded sampling on the continuous engine: the noise is a pure function of (seed, position, token), the draws
follow softmax(logits / temperature) after top_p, and a seeded request gives the same text alone or batched.

The distribution checks are chi-square tests at a 1-in-10,000 level over fixed seeds: deterministic, so they
cannot flake, and a biased hash or a processor out of order fails them by orders of magnitude.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI"):  # CI installs the models extra: a missing one is a failure, not a skip
    import torch
else:
    torch = pytest.importorskip("torch", reason="bin/test installs the 'models' extra these tests need")
    pytest.importorskip("transformers", reason="bin/test installs the 'models' extra these tests need")

from transformers import TemperatureLogitsWarper, TopPLogitsWarper
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)

from gpu_worker.backends.generation import Row
from gpu_worker.backends.interface import Hooks, Outputs, in_order
from gpu_worker.backends.seeded_sampling import (
    NO_NOISE,
    SeededGumbel,
    _mix,
    draw_key,
    gumbel_noise,
    mix32,
)
from harness.models import build_tiny_llama
from tasks.policy.prefixes import prefix_keys
from tasks.schema import SamplingParams
from tests.outputs import generated

Z_1E4 = 3.719  # the standard normal's upper 1e-4 quantile


def chi2_critical(df: int, z: float = Z_1E4) -> float:
    """The chi-square upper quantile for ``df`` degrees of freedom (Wilson-Hilferty; within 1% for df >= 3)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) over the smallest set of likeliest tokens whose mass reaches top_p, renormalised
    (computed here independently of transformers' processors)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ordered, order = torch.sort(probs, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the likelier tokens
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[before < top_p]] = True
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def goodness_of_fit(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, tokens expected fewer than 5 times pooled into one bin."""
    n = float(counts.sum())
    expected = expected_p * n
    big = expected >= 5
    obs = [float(c) for c in counts[big]] + [float(counts[~big].sum())]
    exp = [float(e) for e in expected[big]] + [float(expected[~big].sum())]
    if exp[-1] < 5:  # the pooled bin too small: merge it into the last kept one
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp)), len(obs) - 1


# -- the noise, pure ----------------------------------------------------------------------------------------
def test_python_and_torch_hashes_agree() -> None:
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**32 - 1]
    assert _mix(torch.tensor(xs, dtype=torch.int64)).tolist() == [mix32(x) for x in xs]


def test_the_noise_is_finite_for_every_hash_value() -> None:
    """Every value the uniform is built from gives 0 < u < 1, so no token's noise is infinite (which would draw it
    whatever its logit, and past top_p's cut)."""
    top = torch.arange(1 << 23, dtype=torch.float32)
    u = (top + 0.5) / float(1 << 23)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    big = gumbel_noise(torch.tensor([draw_key(s, t) for s in range(4) for t in range(4)], dtype=torch.int32),
                       152_064)  # Qwen2.5's vocabulary
    assert bool(torch.isfinite(big).all())


def test_a_key_depends_on_seed_and_step() -> None:
    keys = {draw_key(seed, step) for seed in (0, 1, -1, 2**62, 2**63 - 1) for step in range(50)}
    assert len(keys) == 250 and all(0 <= k < 2**31 for k in keys)
    assert draw_key(7, 3) == draw_key(7, 3)


def test_noise_of_a_row_does_not_depend_on_the_others() -> None:
    keys = torch.tensor([draw_key(s, 0) for s in range(6)], dtype=torch.int32)
    together = gumbel_noise(keys, 400)
    for i in range(6):
        assert torch.equal(gumbel_noise(keys[i:i + 1], 400)[0], together[i])
    assert not torch.equal(together[0], together[1])


def test_greedy_rows_get_no_noise() -> None:
    scores = torch.randn(3, 50)
    keys = torch.tensor([NO_NOISE, draw_key(1, 0), NO_NOISE], dtype=torch.int32)
    out = SeededGumbel()(scores, keys)
    assert torch.equal(out[0], scores[0]) and torch.equal(out[2], scores[2])
    assert not torch.equal(out[1], scores[1])


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.6)])
def test_draws_follow_softmax_after_top_p(temperature: float, top_p: float) -> None:
    """The manager's own per-request processors, then the seeded noise, then argmax: 40,000 draws."""
    n, vocab = 40_000, 12
    logits = torch.linspace(-2.0, 2.5, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(3))]
    scores = logits.repeat(n, 1)
    scale = ContinuousBatchingTemperatureLogitsWarper(TemperatureLogitsWarper(max(temperature, 0.01)))
    cut = ContinuousBatchingTopPLogitsWarper(TopPLogitsWarper(0.5))
    as_int = torch.full((n,), temperature, dtype=torch.float32).view(torch.int32)
    scores = scale(scores, as_int)
    scores = cut(scores, torch.full((n,), top_p, dtype=torch.float32).view(torch.int32))
    keys = torch.tensor([draw_key(seed, 5) for seed in range(n)], dtype=torch.int32)
    drawn = SeededGumbel()(scores, keys).argmax(dim=-1)
    counts = torch.bincount(drawn, minlength=vocab)
    expected = nucleus(logits, temperature, top_p)
    assert int(counts[expected == 0].sum()) == 0  # nothing outside the nucleus
    stat, df = goodness_of_fit(counts, expected)
    assert stat < chi2_critical(df), (stat, df, counts.tolist(), (expected * n).round().tolist())


def test_steps_of_one_seed_are_independent_draws() -> None:
    """One seed over 20,000 positions: the same distribution as many seeds at one position."""
    vocab = 6
    logits = torch.tensor([0.1, 1.0, -0.5, 0.7, 0.0, 0.3])
    keys = torch.tensor([draw_key(99, step) for step in range(20_000)], dtype=torch.int32)
    drawn = SeededGumbel()(logits.repeat(len(keys), 1), keys).argmax(dim=-1)
    stat, df = goodness_of_fit(torch.bincount(drawn, minlength=vocab), nucleus(logits, 1.0, 1.0))
    assert stat < chi2_critical(df), stat


# -- the engine, with the tiny model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    folder = build_tiny_llama(Path(tmp_path_factory.mktemp("seeded")) / "m")
    b = HFCausalBackend("tiny", str(folder), "cpu", 100, 256, continuous=EngineConfig())
    yield b
    b.close()


def test_a_seed_gives_the_same_text_alone_or_batched(backend: Any) -> None:
    def text(params: SamplingParams) -> str:
        return generated(backend.run(["hello world"], [params]))[0].text

    asked = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=42)
    alone = text(asked)
    others = [SamplingParams(max_tokens=4 + 7 * i, temperature=0.8 if i % 2 else 0, seed=i) for i in range(10)]
    batch = generated(backend.run([f"the cat {i}" for i in range(5)] + ["hello world"] +
                                  [f"a mat {i}" for i in range(5)], [*others[:5], asked, *others[5:]]))
    assert batch[5].text == alone
    assert text(replace(asked, seed=43)) != alone
    unseeded = SamplingParams(max_tokens=16, temperature=0.8)
    assert text(unseeded) != text(unseeded)


def test_engine_draws_follow_the_model_distribution(backend: Any) -> None:
    """The first token of 2,000 seeded requests for one prompt against softmax(logits / T) after top_p of a
    direct forward pass of the same model."""
    prompt, temperature, top_p, n = "the queue is", 0.25, 0.9, 2000
    ids = backend.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = backend.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    expected = nucleus(logits, temperature, top_p)
    rows = [Row(i, ids, 1, [], logprobs=0, temperature=temperature, top_p=top_p, seed=5000 + i) for i in range(n)]
    outputs: Outputs = {}
    backend.engine.generate(rows, outputs, Hooks())  # the engine itself: its answers keep the token ids
    ids_of = [o.token_ids for o in generated(in_order(outputs, n))]
    firsts = [ids[0] if ids else backend.eos_ids[0] for ids in ids_of]
    counts = torch.bincount(torch.tensor(firsts), minlength=logits.numel())
    assert int(counts[expected == 0].sum()) == 0
    stat, df = goodness_of_fit(counts, expected)
    assert df >= 3, expected.topk(8)  # the check needs a distribution of several likely tokens
    assert stat < chi2_critical(df), (stat, df)


def test_shared_prompt_blocks_are_counted_and_named(backend: Any) -> None:
    system = "the cat sat on a mat; " * 25  # over 512 characters, in the tiny tokenizer's words
    before = backend.prefix_cache()
    for i in range(3):
        backend.run([system + f"question {i}"], [SamplingParams(max_tokens=2, temperature=0)])
    after = backend.prefix_cache()
    assert after.caching and after.queries > before.queries
    assert after.hits - before.hits >= 2 * (after.queries - before.queries) // 3 - 2  # the 2nd and 3rd found it
    assert after.blocks > 0
    assert prefix_keys(system + "question 0")[0] in after.keys
