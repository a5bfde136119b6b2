"""The OpenAI-compatible API, driven by the official `openai` client, with real (tiny) models on workers."""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if os.environ.get("CI"):  # CI installs the models extra: a missing one is a failure, not a skip
    import openai
    import transformers  # noqa: F401
else:
    openai = pytest.importorskip("openai", reason="bin/test installs the 'models' extra these tests need")
    pytest.importorskip("transformers", reason="bin/test installs the 'models' extra these tests need")

from tests.models import build_tiny_llama  # noqa: E402
from tests.stack import Stack  # noqa: E402

LM, EMBED = "tiny-llama", "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def models_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = build_tiny_llama(Path(tmp_path_factory.mktemp("models")) / LM)
    s = Stack(Path(tmp_path_factory.mktemp("openai")), max_tokens_cap=64)
    try:
        s.start_worker(0, backend="hf-causal", model=str(folder))
        s.start_worker(1, backend="hf-embed")
        s.start_batcher()
        s.start_web(workers=1)
        s.wait_ready(workers=2)
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(models_stack: Stack) -> "openai.OpenAI":
    return openai.OpenAI(base_url=models_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_what_the_workers_serve(client: "openai.OpenAI") -> None:
    assert {m.id for m in client.models.list()} == {LM, EMBED}


def test_completions_with_usage(client: "openai.OpenAI") -> None:
    r = client.completions.create(model=LM, prompt="the cat sat", max_tokens=5, temperature=0)
    choice = r.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_outputs_do_not_depend_on_the_batch(client: "openai.OpenAI") -> None:
    prompts = [f"the queue {i} is fast" for i in range(12)]
    alone = [client.completions.create(model=LM, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(lambda p: client.completions.create(
            model=LM, prompt=p, max_tokens=8, temperature=0).choices[0].text, prompts))
    assert together == alone
    many = client.completions.create(model=LM, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == alone


def test_seeded_sampling_is_reproducible(client: "openai.OpenAI") -> None:
    def sample() -> str:
        return client.completions.create(model=LM, prompt="hello", max_tokens=8, temperature=0.9, seed=7,
                                         top_p=0.95).choices[0].text
    assert sample() == sample()


def test_chat_completions_use_the_chat_template(client: "openai.OpenAI") -> None:
    r = client.chat.completions.create(model=LM, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens > 5  # the template's role markers count


def test_embeddings_are_normalised_and_per_input(client: "openai.OpenAI") -> None:
    r = client.embeddings.create(model=EMBED, input=["the cat sat on the mat", "a queue of requests"])
    assert [d.index for d in r.data] == [0, 1]
    for d in r.data:
        assert len(d.embedding) == 384
        assert math.isclose(sum(v * v for v in d.embedding), 1.0, rel_tol=1e-4)
    alone = client.embeddings.create(model=EMBED, input="a queue of requests", encoding_format="float")
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(alone.data[0].embedding, r.data[1].embedding))
    assert r.usage.prompt_tokens > 0


def test_errors_come_back_in_openai_shape(client: "openai.OpenAI") -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=LM, prompt="x", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=LM, prompt="the cat " * 200, max_tokens=60)
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="embed model"):
        client.completions.create(model=EMBED, prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=LM, messages=[{"role": "user"}])
    assert info.value.body["code"] == "invalid_request"  # type: ignore[index]
