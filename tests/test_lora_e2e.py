"""A LoRA adapter on the real engine, end to end (issue 44): a PEFT adapter made here is registered with
`llmb-admin adapters add`, and calls naming it through the HTTP API, batched with calls of the base model, are
answered by the hf-causal worker with the text and logprobs of a second worker that serves the same adapter
merged into the weights (PEFT's ``merge_and_unload``). The worker then reports the adapter resident in its
heartbeat (`llmb-admin workers`). The numbers themselves are checked more finely in test_lora_engine.py."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

if os.environ.get("CI"):  # CI installs the models extra: a missing one is a failure, not a skip
    import peft  # noqa: F401
else:
    pytest.importorskip("torch", reason="bin/test installs the 'models' extra these tests need")
    pytest.importorskip("peft", reason="bin/test installs the 'models' extra these tests need")

from harness.models import build_tiny_llama
from harness.stack import Stack, running_stack, wait_for
from tests.test_lora_engine import make_adapter, merge

BASE, MERGED, ADAPTER = "tiny-base", "tiny-merged", "team-a-tuned"
PROMPTS = ["the cat sat on the mat", "hello world the queue", "a red worker answer", "fast slow token batch"]
TOL = 1e-4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = Path(tmp_path_factory.mktemp("lora-e2e"))
    base = build_tiny_llama(root / BASE)
    adapter = make_adapter(base, root / "adapter", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    merged = merge(base, adapter, root / MERGED)
    workers = [(0, {"backend": "hf-causal", "model": str(base)}), (1, {"backend": "hf-causal", "model": str(merged)})]
    with running_stack(root / "stack", workers=workers, web_workers=1, hf_mode="continuous", max_tokens_cap=32,
                       adapter_cache_s=0.5) as s:
        s.admin("adapters", "add", ADAPTER, "--base", BASE, "--path", str(adapter))
        yield s


def test_an_adapter_call_is_answered_as_the_merged_model_beside_base_calls(stack: Stack) -> None:
    c = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    listed = {m.id: m for m in c.models.list()}
    assert getattr(listed[ADAPTER], "parent", None) == BASE

    def complete(model: str, prompt: str) -> tuple[str, str, list[float]]:
        r = c.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None
        return r.model, r.choices[0].text, [float(x) for x in lp.token_logprobs]

    wait_for(lambda: complete(ADAPTER, PROMPTS[0])[0] == ADAPTER, 60, "the adapter served")
    with ThreadPoolExecutor(8) as pool:  # adapter and base rows at once: they share the base worker's steps
        mixed = list(pool.map(lambda mp: complete(*mp), [(m, p) for p in PROMPTS for m in (ADAPTER, BASE)]))
        reference = list(pool.map(lambda p: complete(MERGED, p), PROMPTS))
    adapter_rows, base_rows = mixed[0::2], mixed[1::2]
    assert all(model == ADAPTER for model, _, _ in adapter_rows), "the answer names the adapter called"
    for (_, text, logprobs), (_, want_text, want_logprobs) in zip(adapter_rows, reference):
        assert text == want_text
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < TOL
    assert [text for _, text, _ in base_rows] != [text for _, text, _ in adapter_rows], "the adapter changes text"

    def resident() -> bool:
        workers = json.loads(stack.admin("workers", "--json").stdout)
        return any(ADAPTER in (w.get("adapters") or []) for w in workers)

    wait_for(resident, 30, "the worker's heartbeat reporting the adapter resident")
