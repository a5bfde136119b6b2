"""LoRA adapters on hf-causal: rows of different adapters (and of none) in one forward pass give, row by row, the
greedy text and logprobs of the model with that adapter merged into its weights (PEFT's ``merge_and_unload``),
alone and batched together, on the continuous engine and in static mode; residency (LRU, pinning, loading off the
decoding loop), the per-step cap on distinct adapters, and adapters that cannot be served (their rows alone fail).

The tiny random Llama and random LoRA weights (``init_lora_weights=False``: B is not zero) are made here with PEFT;
the text is arbitrary, what is asserted is equality with the merged model.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("CI"):  # CI installs the models extra: a missing one is a failure, not a skip
    import peft
    import torch
else:
    torch = pytest.importorskip("torch", reason="bin/test installs the 'models' extra these tests need")
    pytest.importorskip("transformers", reason="bin/test installs the 'models' extra these tests need")
    peft = pytest.importorskip("peft", reason="bin/test installs the 'models' extra these tests need")

from gpu_worker.backends.interface import AdapterState, ItemError
from harness.models import build_tiny_llama
from tasks.schema import GenerationOutput, SamplingParams
from tests.outputs import generated

PROMPTS = ["the cat sat on the mat", "hello world the queue", "a red worker answer", "fast slow token batch model"]
# three adapters unlike each other: attention only; every linear layer with rsLoRA; MLP and output projections
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 8, "lora_alpha": 16, "use_rslora": True,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "mlp": {"r": 2, "lora_alpha": 4, "target_modules": ["o_proj", "down_proj", "up_proj"]},
}
TOL = 1e-4


def make_adapter(base: Path, folder: Path, seed: int, **config: Any) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base))
    lora = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # large enough a delta that each adapter's greedy text differs from the base model's
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    lora.save_pretrained(str(folder))
    return folder


def merge(base: Path, adapter: Path, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base))
    merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base model, each adapter's PEFT directory, and each adapter merged into a model of its own."""
    root = Path(tmp_path_factory.mktemp("lora"))
    base = build_tiny_llama(root / "base")
    out = {"base": base}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        out[name] = make_adapter(base, root / f"adapter-{name}", seed + 1, **config)
        out[f"merged-{name}"] = merge(base, out[name], root / f"merged-{name}")
    return out


def backend(path: Path, continuous: bool, **kw: Any) -> Any:
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    return HFCausalBackend("tiny", str(path), "cpu", 100, 64, continuous=EngineConfig() if continuous else None, **kw)


def params(models: dict[str, Path], adapter: str | None, **kw: Any) -> SamplingParams:
    if adapter is not None:
        kw.update(adapter=adapter, adapter_path=str(models[adapter]))
    return SamplingParams(max_tokens=kw.pop("max_tokens", 10), temperature=0, logprobs=2, **kw)


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[tuple[str | None, str], GenerationOutput]:
    """Each (adapter, prompt)'s answer from the merged model (the base model's for None), alone, static mode."""
    out = {}
    for name in [None, *ADAPTERS]:
        b = backend(models["base" if name is None else f"merged-{name}"], continuous=False)
        try:
            for prompt in PROMPTS:
                out[(name, prompt)] = generated(b.run([prompt], [SamplingParams(max_tokens=10, temperature=0,
                                                                                 logprobs=2)]))[0]
        finally:
            b.close()
    return out


@pytest.fixture(scope="module", params=["continuous", "static"])
def served(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[Any]:
    b = backend(models["base"], request.param == "continuous", max_adapters=16, adapters_per_step=4)
    yield b
    b.close()


def same(got: GenerationOutput, want: GenerationOutput) -> None:
    assert got.text == want.text and got.completion_tokens == want.completion_tokens, (got.text, want.text)
    assert [e["token"] for e in got.logprobs or []] == [e["token"] for e in want.logprobs or []]
    for g, w in zip(got.logprobs or [], want.logprobs or []):
        assert g["logprob"] == pytest.approx(w["logprob"], abs=TOL)
        assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]]
        assert [lp for _, lp in g["top"]] == pytest.approx([lp for _, lp in w["top"]], abs=TOL)


def test_the_adapters_change_the_answers(reference: dict[tuple[str | None, str], GenerationOutput]) -> None:
    """Otherwise every equality below would hold for a backend that ignored adapters."""
    for name in ADAPTERS:
        assert [reference[(name, p)].text for p in PROMPTS] != [reference[(None, p)].text for p in PROMPTS], name


def test_each_adapter_alone_equals_its_merged_model(served: Any, models: dict[str, Path],
                                                    reference: dict[tuple[str | None, str], GenerationOutput]) -> None:
    for name in ADAPTERS:
        outs = generated(served.run([PROMPTS[0]], [params(models, name)]))
        same(outs[0], reference[(name, PROMPTS[0])])


def test_mixed_adapters_and_base_rows_in_one_batch(served: Any, models: dict[str, Path],
                                                   reference: dict[tuple[str | None, str], GenerationOutput]) -> None:
    """Every prompt with every adapter and with none, interleaved in one batch of 16 rows."""
    names: list[str | None] = [None, *ADAPTERS]
    rows = [(names[(i + j) % len(names)], p) for j, p in enumerate(PROMPTS) for i in range(len(names))]
    outs = generated(served.run([p for _, p in rows], [params(models, n) for n, _ in rows]))
    for (name, prompt), out in zip(rows, outs):
        same(out, reference[(name, prompt)])
    state: AdapterState = served.adapters()
    assert set(state.resident) == set(ADAPTERS) and state.max_adapters == 16 and not state.loading


def test_a_missing_or_refused_adapter_fails_its_rows_alone(served: Any, models: dict[str, Path], tmp_path: Path,
                                                          reference: dict[tuple[str | None, str],
                                                                          GenerationOutput]) -> None:
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((models["attn"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((models["attn"] / "adapter_model.safetensors").read_bytes())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    ps = [SamplingParams(max_tokens=10, temperature=0, logprobs=2, adapter="gone", adapter_path=str(tmp_path / "no")),
          params(models, None),
          SamplingParams(max_tokens=10, temperature=0, adapter="dora", adapter_path=str(dora)),
          SamplingParams(max_tokens=10, temperature=0, adapter="broken", adapter_path=str(broken)),
          params(models, "mlp")]
    outs = served.run([PROMPTS[1]] * len(ps), ps)
    assert isinstance(outs[0], ItemError) and outs[0].type == "invalid_request" and "adapter_config" in outs[0].message
    assert isinstance(outs[2], ItemError) and "DoRA" in outs[2].message
    assert isinstance(outs[3], ItemError) and "unreadable" in outs[3].message
    same(outs[1], reference[(None, PROMPTS[1])])
    same(outs[4], reference[("mlp", PROMPTS[1])])
    assert not {"gone", "dora", "broken"} & set(served.adapters().resident + served.adapters().loading)


def test_a_worker_without_adapter_slots_refuses_adapter_rows(models: dict[str, Path]) -> None:
    b = backend(models["base"], continuous=False)
    try:
        outs = b.run([PROMPTS[0]] * 2, [params(models, "attn"), params(models, None)])
        assert isinstance(outs[0], ItemError) and "LLMB_MAX_ADAPTERS=0" in outs[0].message
        assert isinstance(outs[1], GenerationOutput)
        assert b.adapters() == AdapterState()
    finally:
        b.close()


# -- residency, loading and the per-step cap, on the real engine ----------------------------------------------
@pytest.fixture
def small(models: dict[str, Path]) -> Iterator[Any]:
    """A continuous worker that holds 2 adapters at most and lets 2 distinct adapters into a step."""
    b = backend(models["base"], continuous=True, max_adapters=2, adapters_per_step=2)
    yield b
    b.close()


def test_least_recently_used_is_evicted_and_pinned_never(small: Any, models: dict[str, Path],
                                                         reference: dict[tuple[str | None, str],
                                                                         GenerationOutput]) -> None:
    for name in ["attn", "all", "mlp"]:  # the third evicts the least recently used (attn)
        same(generated(small.run([PROMPTS[2]], [params(models, name)]))[0], reference[(name, PROMPTS[2])])
    state = small.adapters()
    assert state.resident == ("mlp", "all") and (state.loads, state.evictions) == (3, 1)
    generated(small.run([PROMPTS[0]], [params(models, "all", adapter_pinned=True)]))  # pinned, and now the MRU
    generated(small.run([PROMPTS[0]], [params(models, "mlp")]))  # all is now the LRU, but pinned
    same(generated(small.run([PROMPTS[3]], [params(models, "attn")]))[0], reference[("attn", PROMPTS[3])])
    state = small.adapters()
    assert state.resident == ("attn", "all") and (state.loads, state.evictions) == (4, 2)


def test_three_adapters_in_one_batch_on_two_slots(small: Any, models: dict[str, Path],
                                                 reference: dict[tuple[str | None, str], GenerationOutput]) -> None:
    """The third adapter waits for a slot (rows of the first two end, their adapter is evicted), then runs; no
    step has more than 2 distinct adapters, and some have 2 (the cap is used, not serialised)."""
    seen: list[int] = []
    set_gather = small.lora.set

    def record(gather: Any) -> None:
        if gather is not None:
            seen.append(len(gather.groups))
        set_gather(gather)

    small.lora.set = record
    names: list[str | None] = [None, "attn", "all", "mlp"]
    rows = [(names[(i + j) % 4], p) for j, p in enumerate(PROMPTS) for i in range(4)]
    outs = generated(small.run([p for _, p in rows], [params(models, n) for n, _ in rows]))
    for (name, prompt), out in zip(rows, outs):
        same(out, reference[(name, prompt)])
    assert max(seen) == 2, seen
    assert small.adapters().loads == 3 and len(small.adapters().resident) == 2


def test_concurrent_batches_share_the_slots_and_steps(small: Any, models: dict[str, Path],
                                                     reference: dict[tuple[str | None, str],
                                                                     GenerationOutput]) -> None:
    """Three batches at once (the worker's pool threads), three adapters on two slots: each row as merged."""
    mixes: list[list[str | None]] = [["attn", None, "mlp", "attn"], ["all", "all", None, "mlp"], ["mlp", "attn", "all"]]
    got: dict[int, list[Any]] = {}

    def one(k: int) -> None:
        got[k] = small.run([PROMPTS[i % 4] for i in range(len(mixes[k]))], [params(models, n) for n in mixes[k]])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(mixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k, names in enumerate(mixes):
        for i, (name, out) in enumerate(zip(names, generated(got[k]))):
            same(out, reference[(name, PROMPTS[i % 4])])
    assert not small.pool.residency.in_use and len(small.adapters().resident) == 2


def test_static_mode_runs_adapters_in_waves_that_fit(models: dict[str, Path],
                                                     reference: dict[tuple[str | None, str],
                                                                     GenerationOutput]) -> None:
    b = backend(models["base"], continuous=False, max_adapters=2, adapters_per_step=4)
    try:
        names: list[str | None] = ["mlp", None, "attn", "all", "attn", "mlp"]
        outs = generated(b.run([PROMPTS[i % 4] for i in range(6)], [params(models, n) for n in names]))
        for i, (name, out) in enumerate(zip(names, outs)):
            same(out, reference[(name, PROMPTS[i % 4])])
        assert len(b.adapters().resident) == 2
    finally:
        b.close()


def test_rows_go_on_while_an_adapter_loads(small: Any, models: dict[str, Path],
                                           reference: dict[tuple[str | None, str], GenerationOutput]) -> None:
    """A load held back on the loader thread: other batches' rows (base and resident adapter) are answered
    meanwhile, the heartbeat shows it loading, and its row runs once it is resident."""
    generated(small.run([PROMPTS[0]], [params(models, "attn")]))
    gate = threading.Event()
    load = small.pool.load

    def slow(name: str, path: str) -> Any:
        assert gate.wait(30)
        return load(name, path)

    small.pool.load = slow
    waiting: list[Any] = []
    t = threading.Thread(target=lambda: waiting.extend(small.run([PROMPTS[1]], [params(models, "mlp")])))
    t.start()
    try:
        outs = generated(small.run([PROMPTS[2], PROMPTS[3]], [params(models, None), params(models, "attn")]))
        same(outs[0], reference[(None, PROMPTS[2])])
        same(outs[1], reference[("attn", PROMPTS[3])])
        assert small.adapters().loading == ("mlp",) and not waiting
    finally:
        gate.set()
        t.join(30)
    same(generated(waiting)[0], reference[("mlp", PROMPTS[1])])
    assert small.adapters().loading == () and "mlp" in small.adapters().resident


def test_cached_prompt_blocks_are_never_shared_across_adapters(models: dict[str, Path]) -> None:
    """A long prompt's KV blocks depend on the adapter (k and v projections, every layer after the first): a row
    of one adapter must not take the blocks cached by the base model's row or another adapter's, and rows of the
    same adapter do share theirs."""
    long = " ".join(["the cat sat on the mat and the worker answered the request"] * 8)  # several 32-token pages
    want = {}
    for name in [None, "all", "attn"]:
        b = backend(models["base" if name is None else f"merged-{name}"], continuous=True)
        try:
            want[name] = generated(b.run([long], [SamplingParams(max_tokens=6, temperature=0, logprobs=2)]))[0]
        finally:
            b.close()
    b = backend(models["base"], continuous=True, max_adapters=4)
    try:
        for name in [None, "all", "attn", None, "all"]:  # each after the others cached the same prompt's blocks
            before = b.prefix_cache()
            same(generated(b.run([long], [params(models, name, max_tokens=6)]))[0], want[name])
        assert b.prefix_cache().hits > before.hits  # the second "all" row found its own blocks
    finally:
        b.close()


def test_a_text_scored_with_an_adapter_gets_the_merged_models_logprobs(served: Any, models: dict[str, Path]) -> None:
    """echo with max_tokens 0 generates nothing, but its logprobs are still the adapter's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(models["base"]))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    outs = generated(served.run([PROMPTS[0]] * 2, [params(models, "all", max_tokens=0, echo=True),
                                                    params(models, None, max_tokens=0, echo=True)]))
    for name, out in zip(["merged-all", "base"], outs):
        model = AutoModelForCausalLM.from_pretrained(str(models[name])).eval()
        with torch.no_grad():
            want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
        got = [e["logprob"] for e in out.prompt_logprobs or []][1:]
        assert got == pytest.approx([float(want[t - 1, ids[t]]) for t in range(1, len(ids))], abs=TOL), name


def test_gpt2_conv1d_layers_fan_in_fan_out(tmp_path: Path) -> None:
    """GPT-2 stores its projections transposed (Conv1D; PEFT's fan_in_fan_out): the hooks' logits equal the merged
    model's, for a pass with the adapter and one without."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpu_worker.backends.lora import LoraHooks, read_adapter, whole

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    base.save_pretrained(str(tmp_path / "gpt2"))
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                     fan_in_fan_out=True, init_lora_weights=False))
    lora.save_pretrained(str(tmp_path / "adapter"))
    merged = lora.merge_and_unload().eval()
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "gpt2")).eval()
    hooks = LoraHooks(model)
    hooks.activate()
    adapter = read_adapter("a", str(tmp_path / "adapter"), hooks.modules, torch.device("cpu"), torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with hooks.using(whole(adapter)):
            adapted = model(input_ids=ids).logits
        want = merged(input_ids=ids).logits
    assert torch.allclose(adapted, want, atol=TOL) and not torch.allclose(plain, want, atol=TOL)


def test_embedding_and_head_lora_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from gpu_worker.backends.lora import AdapterError, read_adapter, targetable

    modules = targetable(AutoModelForCausalLM.from_pretrained(str(models["base"])))
    for target in ["embed_tokens", "lm_head"]:  # PEFT saves these layers whole beside their LoRA pair
        make_adapter(models["base"], tmp_path / target, 7, r=2, lora_alpha=4, target_modules=[target])
        with pytest.raises(AdapterError, match="does not support"):
            read_adapter(target, str(tmp_path / target), modules, torch.device("cpu"), torch.float32)


def test_the_worker_builds_hf_causal_with_its_adapter_settings(models: dict[str, Path]) -> None:
    """LLMB_MAX_ADAPTERS and LLMB_MAX_ADAPTERS_PER_BATCH reach the backend (the heartbeat reads adapters())."""
    from gpu_worker.backends.registry import load_backend
    from tasks.config import Settings

    b: Any = load_backend("hf-causal", Settings.of(max_adapters=3, max_adapters_per_batch=2, hf_mode="static"),
                          model=str(models["base"]))
    try:
        assert b.adapters() == AdapterState(max_adapters=3) and b.adapters_per_step == 2
        assert not b.lora._handles  # no hook on the model until an adapter loads: base rows run it untouched
        same(generated(b.run([PROMPTS[0]], [params(models, "mlp")]))[0],
             generated(backend(models["merged-mlp"], False).run([PROMPTS[0]], [params(models, None)]))[0])
        assert b.adapters().resident == ("mlp",) and b.adapters().loads == 1 and b.lora._handles
    finally:
        b.close()
