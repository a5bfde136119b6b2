"""The OpenAI-compatible API, driven by the official `openai` client, with real (tiny) models on workers."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if os.environ.get("CI"):  # CI installs the models extra: a missing one is a failure, not a skip
    import openai
    import transformers  # noqa: F401
else:
    openai = pytest.importorskip("openai", reason="bin/test installs the 'models' extra these tests need")
    pytest.importorskip("transformers", reason="bin/test installs the 'models' extra these tests need")

from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.models import build_tiny_llama
from harness.stack import Stack, running_stack, wait_for
from tasks.schema import SamplingParams
from tasks.store.models import RequestRecord, make_engine
from tests.outputs import generated

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

LM, EMBED = "tiny-llama", "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def models_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = build_tiny_llama(Path(tmp_path_factory.mktemp("models")) / LM)
    workers = [(0, {"backend": "hf-causal", "model": str(folder)}), (1, {"backend": "hf-embed"})]
    # a stream its client leaves is cancelled at once (hf-causal's cancellation is what is tested here; the default
    # resume window is tested in test_stream_resume.py and test_idempotency.py)
    with running_stack(Path(tmp_path_factory.mktemp("openai")), workers=workers, web_workers=1, max_tokens_cap=64,
                       hf_mode="continuous", store_inputs="true", stream_resume_ms=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(models_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=models_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_what_the_workers_serve(client: openai.OpenAI) -> None:
    assert {m.id for m in client.models.list()} == {LM, EMBED}


def test_completions_with_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=LM, prompt="the cat sat", max_tokens=5, temperature=0)
    choice = r.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("length", "stop")
    assert r.usage is not None
    assert 1 <= r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_outputs_do_not_depend_on_the_batch(client: openai.OpenAI) -> None:
    prompts = [f"the queue {i} is fast" for i in range(12)]
    alone = [client.completions.create(model=LM, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(lambda p: client.completions.create(
            model=LM, prompt=p, max_tokens=8, temperature=0).choices[0].text, prompts))
    assert together == alone
    many = client.completions.create(model=LM, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == alone


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> str:
        return client.completions.create(model=LM, prompt="hello", max_tokens=8, temperature=0.9, seed=7,
                                         top_p=0.95).choices[0].text
    assert sample() == sample()


def test_a_seed_gives_the_same_text_alone_or_beside_other_calls(client: openai.OpenAI) -> None:
    """Sampled calls run on the continuous engine with the others (the seeded sampler), each by its own seed."""
    def sample(seed: int, max_tokens: int = 12, temperature: float = 0.8) -> str:
        return client.completions.create(model=LM, prompt="the worker sat", max_tokens=max_tokens,
                                         temperature=temperature, top_p=0.95, seed=seed).choices[0].text
    alone = sample(21)
    others = [(i, 4 + 9 * (i % 4), 0.0 if i % 3 == 0 else 0.9) for i in range(11)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        mine = pool.submit(sample, 21)
        beside = list(pool.map(lambda o: sample(*o), others))
        assert mine.result() == alone
    assert len(beside) == len(others)
    assert sample(22) != alone


def test_shared_prompt_starts_show_in_the_fleet_view(models_stack: Stack, client: openai.OpenAI) -> None:
    """Prompt blocks the continuous engine found cached: counted in the heartbeat, shown by `llmb-admin workers`."""
    system = "the cat sat on a mat; " * 25
    for i in range(3):
        client.completions.create(model=LM, prompt=system + f"question {i}", max_tokens=2, temperature=0)

    def hits() -> dict[str, Any] | None:
        beat = next((w for w in models_stack.fleet().values() if w["model"] == LM), None)
        return beat if beat and beat["prefix_hits"] > 0 else None

    wait_for(hits, 15, "prefix hits in the tiny model's heartbeat")
    beat = hits()
    assert beat is not None and beat["prefix_caching"] and beat["cached_blocks"] > 0 and beat["prefixes"]
    row = next(line for line in models_stack.admin("workers").stdout.splitlines() if f" {LM} " in line)
    assert "%" in row.split()[10], row  # PREFIX HIT: a share, not '-'


def test_chat_completions_use_the_chat_template(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=LM, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage is not None
    assert r.usage.prompt_tokens > 5  # the template's role markers count


def _ledger_record(stack: Stack, correlation_id: str) -> RequestRecord:
    with Session(make_engine(stack.database_url)) as s:
        query = select(RequestRecord).where(RequestRecord.correlation_id == correlation_id,
                                            RequestRecord.status == "ok")
        wait_for(lambda: s.scalars(query).first(), 10, f"{correlation_id} in the ledger")
        return s.scalars(query).one()


def test_requeue_sends_the_same_call_again(models_stack: Stack, client: openai.OpenAI) -> None:
    """Chat or completion, sampling parameters, seed and priority class all come back from the ledger."""
    chat = client.chat.completions.with_raw_response.create(
        model=LM, max_tokens=7, temperature=0.9, top_p=0.9, seed=11, service_tier="flex",
        messages=[{"role": "user", "content": "tell me a story"}])
    plain = client.completions.with_raw_response.create(model=LM, prompt="once upon", max_tokens=5,
                                                        temperature=0.8, seed=3)
    for raw, text in ((chat, chat.parse().choices[0].message.content), (plain, plain.parse().choices[0].text)):
        record = _ledger_record(models_stack, raw.headers["X-Request-Id"])
        again = models_stack.admin("requeue", record.id)
        assert record.id in again.stdout and f'"text": {json.dumps(text)}' in again.stdout, (text, again.stdout)
        replayed = _ledger_record(models_stack, f"replay-{record.id}")
        assert (replayed.tenant, replayed.model, replayed.priority, replayed.params) == \
            (record.tenant, record.model, record.priority, record.params)
    first = _ledger_record(models_stack, chat.headers["X-Request-Id"])
    assert first.priority == "offline" and json.loads(first.params or "{}")["chat"] is True
    assert json.loads(first.params or "{}")["seed"] == 11


def test_embeddings_are_normalised_and_per_input(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model=EMBED, input=["the cat sat on the mat", "a queue of requests"])
    assert [d.index for d in r.data] == [0, 1]
    for d in r.data:
        assert len(d.embedding) == 384
        assert math.isclose(sum(v * v for v in d.embedding), 1.0, rel_tol=1e-4)
    alone = client.embeddings.create(model=EMBED, input="a queue of requests", encoding_format="float")
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(alone.data[0].embedding, r.data[1].embedding))
    assert r.usage.prompt_tokens > 0


def test_errors_come_back_in_openai_shape(client: openai.OpenAI, models_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=LM, prompt="x", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=LM, prompt="the cat " * 200, max_tokens=60)
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from harness.stack import wait_for
    from tasks.store.models import RequestRecord, make_engine

    with Session(make_engine(models_stack.database_url)) as s:  # the ledger says why it was not answered
        wait_for(lambda: s.scalars(select(RequestRecord).where(RequestRecord.status == "rejected")).first(),
                 10, "the rejected request in the ledger")
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="embed model"):
        client.completions.create(model=EMBED, prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        # a user message without its content, on purpose: the server must refuse it
        client.chat.completions.create(model=LM, messages=[{"role": "user"}])  # type: ignore[typeddict-item]
    assert info.value.body["code"] == "invalid_request"  # type: ignore[index]


def test_streamed_text_adds_up_to_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=LM, prompt="the worker", max_tokens=12, temperature=0)
    pieces = list(client.completions.create(model=LM, prompt="the worker", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len(pieces) >= 2


def test_streamed_chat_in_openai_chunk_format(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=LM, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=LM, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason is not None


def test_a_client_that_leaves_mid_stream_cancels_its_generation(models_stack: Stack,
                                                               client: openai.OpenAI) -> None:
    import requests

    pubsub = models_stack.redis.pubsub()
    pubsub.subscribe(f"{models_stack.namespace}:cancel")
    with ThreadPoolExecutor(max_workers=1) as pool:
        # keep the worker busy, so the streamed request is still waiting when its client leaves
        busy = pool.submit(client.completions.create, model=LM, prompt=[f"busy {i}" for i in range(100)],
                           max_tokens=64, temperature=0)
        wait_for(lambda: models_stack.inflight() >= 100, 30, "the 100 busy prompts to be admitted")
        with requests.post(models_stack.url + "/v1/completions", stream=True, timeout=30, json={
                "model": LM, "prompt": "the cat", "max_tokens": 64, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        busy.result()
    cancelled: list[bytes] = []

    def published() -> bool:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "message":
            cancelled.append(message["data"])
        return bool(cancelled)

    wait_for(published, 10, "a message on the cancel channel")
    assert cancelled[0], "leaving a stream publishes its item id on the cancel channel"


def test_a_cancelled_row_stops_while_the_rest_of_its_batch_goes_on(tmp_path: Path) -> None:
    from gpu_worker.backends.hf_causal import HFCausalBackend
    from gpu_worker.backends.interface import Hooks

    backend = HFCausalBackend("tiny", str(build_tiny_llama(tmp_path / "m")), "cpu", 8, 64)
    params = [SamplingParams(max_tokens=20, temperature=0)] * 2
    out = generated(backend.run(["the cat", "the mat"], params, Hooks(cancelled=lambda position: position == 0)))
    assert out[0].completion_tokens <= 1 < out[1].completion_tokens


def test_workers_and_stats_report_tokens_utilisation_and_cost(models_stack: Stack, client: openai.OpenAI) -> None:
    import json as json_
    import threading

    stop = threading.Event()
    answered: list[int] = []

    def traffic() -> None:  # closed-loop load: the next call as soon as one is answered
        while not stop.is_set():
            client.completions.create(model=LM, prompt=[f"load {i}" for i in range(20)], max_tokens=16,
                                      temperature=0)
            answered.append(1)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        wait_for(lambda: answered or not worker.is_alive(), 60, "the traffic's first answer")
        assert answered, "the traffic failed before its first answer"
        stats = json_.loads(models_stack.admin("stats", "--interval", "4", "--json").stdout)
    finally:
        stop.set()
        worker.join()
    assert stats["tokens_per_s"] > 0 and 0 < stats["device_busy_fraction"] <= 1
    assert stats["cost_per_million_tokens"] > 0
    fleet = {w["model"]: w for w in json_.loads(models_stack.admin("workers", "--json").stdout)}
    assert fleet[LM]["tokens_per_s"] > 0 and fleet[LM]["utilisation"] > 0 and fleet[LM]["kind"] == "causal"
    assert fleet[EMBED]["kind"] == "embed" and fleet[LM]["max_context"] == 256
    assert fleet[LM]["slots"] > 1 and fleet[LM]["kv_tokens"] > 0  # continuous batching and its KV budget


def test_continuous_batching_gives_the_same_greedy_text_as_padded_generate(tmp_path: Path) -> None:
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    folder = str(build_tiny_llama(tmp_path / "m"))
    static = HFCausalBackend("tiny", folder, "cpu", 32, 64)
    continuous = HFCausalBackend("tiny", folder, "cpu", 32, 64, continuous=EngineConfig(64, 32, 256, 16))
    try:
        _compare(static, continuous)
    finally:
        continuous.close()


def _compare(static: Any, continuous: Any) -> None:
    from gpu_worker.backends.interface import Hooks

    prompts = [f"the batch {i} is red" for i in range(12)]
    params = [SamplingParams(max_tokens=4 + 5 * (i % 4), temperature=0) for i in range(12)]  # mixed lengths
    assert continuous.run(prompts, params) == static.run(prompts, params)
    streamed: dict[int, str] = {}

    def stream(deltas: list[tuple[int, str]]) -> None:
        for p, t in deltas:
            streamed[p] = streamed.get(p, "") + t

    out = generated(continuous.run(prompts[:2], params[:2], Hooks(streaming={0, 1}, stream=stream)))
    for position, o in enumerate(out):  # the API sends whatever the stream held back with the final chunk
        assert streamed.get(position) and o.text.startswith(streamed[position])
    cancelled = generated(continuous.run(prompts[:2], [SamplingParams(max_tokens=40, temperature=0)] * 2,
                                         Hooks(cancelled=lambda position: position == 0)))
    assert cancelled[0].finish_reason == "cancelled" and cancelled[1].completion_tokens > 0


def test_structured_output_on_hf_causal_parses_beside_free_rows(client: openai.OpenAI) -> None:
    """The openai client's .parse with a Pydantic model, end to end on the real engine: every constrained answer
    parses into the model, and free greedy rows in the same batches answer as they do alone."""
    from typing import Literal

    from pydantic import BaseModel

    class Pick(BaseModel):
        kind: Literal["cat", "mat"]
        ok: bool

    def constrained(i: int) -> Any:
        return client.chat.completions.parse(model=LM, messages=[{"role": "user", "content": f"pick {i}"}],
                                             response_format=Pick, max_tokens=64, temperature=1.0, seed=i)

    def free(i: int) -> str | None:
        return client.completions.create(model=LM, prompt=f"the mat {i}", max_tokens=8,
                                         temperature=0).choices[0].text

    alone = [free(i) for i in range(6)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        picks = [pool.submit(constrained, i) for i in range(6)]
        beside = [pool.submit(free, i) for i in range(6)]
        answers = [p.result() for p in picks]
        assert [f.result() for f in beside] == alone
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pick), choice



def test_embeddings_refuse_a_field_they_do_not_honour(client: openai.OpenAI) -> None:
    """``dimensions`` would ask for a shorter vector than the model gives: a 400 naming it, never ignored; so is
    a field /v1/embeddings does not know."""
    for extra, named in (({"dimensions": 8}, "'dimensions'"), ({"dimension": 8}, "'dimension'"),
                         ({"user": 3}, "'user'")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=EMBED, input="x", extra_body=extra)
        assert named in refused.value.message, refused.value.message
    assert len(client.embeddings.create(model=EMBED, input="x", user="u1").data[0].embedding) == 384
