"""OpenAI fields the ecosystem sends, driven by the official `openai` client against a sim-lm worker: usage in
streams (``stream_options.include_usage``, as LangChain's ``stream_usage`` and LiteLLM's spend tracking ask for),
and a prompt too long for the model's context refused with a 400 before any stream starts."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

if os.environ.get("CI"):  # CI installs the test extra: a missing client is a failure, not a skip
    import openai
else:
    openai = pytest.importorskip("openai", reason="bin/test installs the 'test' extra these tests need")

from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.stack import Stack, running_stack, wait_for
from tasks.schema import SamplingParams
from tasks.store.models import RequestRecord, make_engine
from tests.outputs import generated

LM = "sim-lm"
TOO_LONG = "the cat sat on the mat " * 1200  # about 7,000 tokens: sim-lm's context is 4,096


@pytest.fixture(scope="module")
def lm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("fields")), workers=[(0, {"backend": "sim-lm"})],
                       web_workers=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(lm_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=lm_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ledger_tokens(stack: Stack, request_id: str) -> tuple[int | None, int | None]:
    """The prompt and completion tokens the ledger holds for the call's one item (waited for: it is written
    after the answer)."""
    with Session(make_engine(stack.database_url)) as s:
        def row() -> RequestRecord | None:
            s.expire_all()
            return s.scalars(select(RequestRecord).where(RequestRecord.correlation_id == request_id,
                                                         RequestRecord.status == "ok")).first()

        wait_for(lambda: row() is not None, 20, f"the ledger row of {request_id}")
        found = row()
        assert found is not None
        return found.prompt_tokens, found.completion_tokens


def test_a_streamed_chat_with_include_usage_ends_with_the_counts(client: openai.OpenAI, lm_stack: Stack) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "count my tokens"}]
    whole = client.chat.completions.create(model=LM, messages=messages, max_tokens=12, seed=7)
    raw = client.chat.completions.with_raw_response.create(model=LM, messages=messages, max_tokens=12, seed=7,
                                                           stream=True, stream_options={"include_usage": True})
    request_id = raw.headers["X-Request-Id"]
    chunks = list(raw.parse())
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert all(c.usage is None and len(c.choices) == 1 for c in text_chunks), "usage null on every other chunk"
    assert whole.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == whole.choices[0].message.content
    assert ledger_tokens(lm_stack, request_id) == (last.usage.prompt_tokens, last.usage.completion_tokens)


def test_a_streamed_completion_with_include_usage_and_without(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=LM, prompt="the cat", max_tokens=8, seed=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens > 0 and chunks[-1].usage.completion_tokens > 0
    assert chunks[-2].choices[0].finish_reason is not None
    plain = list(client.completions.create(model=LM, prompt="the cat", max_tokens=8, seed=3, stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in plain), "no usage chunk unless asked for"
    assert "".join(c.choices[0].text for c in plain) == "".join(c.choices[0].text for c in chunks[:-1])


def test_stream_options_are_checked_as_openai_checks_them(lm_stack: Stack) -> None:
    url = lm_stack.url + "/v1/chat/completions"
    base: dict[str, Any] = {"model": LM, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with requests.Session() as http:
        for body, needle in (({**base, "stream_options": {"include_usage": True}}, "only allowed when 'stream'"),
                             ({**base, "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
                             ({**base, "stream": True, "stream_options": {"other": 1}}, "include_usage"),
                             ({**base, "stream": True, "stream_options": [1]}, "include_usage"),
                             ({**base, "stream": "yes"}, "'stream' must be true or false")):
            r = http.post(url, json=body, timeout=30)
            assert r.status_code == 400 and r.headers["Content-Type"].startswith("application/json"), r.text
            assert needle in r.json()["error"]["message"], r.json()


def test_a_prompt_longer_than_the_context_is_a_400_before_any_stream_starts(client: openai.OpenAI,
                                                                            lm_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as streamed:  # the status, before the client reads any chunk
        client.chat.completions.create(model=LM, messages=[{"role": "user", "content": TOO_LONG}], max_tokens=16,
                                       stream=True)
    assert isinstance(streamed.value.body, dict), streamed.value.body
    assert streamed.value.body["code"] == "context_length_exceeded", streamed.value.body
    assert "more than this model's context of 4096" in streamed.value.body["message"]
    with pytest.raises(openai.BadRequestError) as whole:
        client.completions.create(model=LM, prompt=TOO_LONG, max_tokens=16)
    assert isinstance(whole.value.body, dict) and whole.value.body["code"] == "context_length_exceeded"
    with requests.post(lm_stack.url + "/v1/completions", timeout=30, stream=True,
                       json={"model": LM, "prompt": TOO_LONG, "max_tokens": 16, "stream": True}) as r:
        assert r.status_code == 400 and r.headers["Content-Type"].startswith("application/json"), r.headers
        assert r.json()["error"]["type"] == "invalid_request_error"
    # and the stream beside it is unaffected: a fitting prompt streams as before
    assert "".join(c.choices[0].text for c in client.completions.create(
        model=LM, prompt="short", max_tokens=4, seed=1, stream=True))


def test_each_choice_of_a_seeded_call_has_a_seed_of_its_own() -> None:
    from tasks.policy.batcher import SEED_SPAN, choice_params

    params = SamplingParams(seed=10, n=3, max_tokens=4)
    assert [choice_params(params, i).seed for i in range(6)] == [10, 11, 12, 10, 11, 12]  # two prompts
    assert choice_params(params, 3) is params  # each prompt's first choice: as the call asked
    unseeded = SamplingParams(seed=None, n=3)
    assert all(choice_params(unseeded, i) is unseeded for i in range(3))  # fresh randomness makes them differ
    assert choice_params(SamplingParams(seed=SEED_SPAN - 1, n=2), 1).seed == 0  # wraps inside torch's seed range


def test_n_choices_are_items_of_one_call_reproducible_with_a_seed(client: openai.OpenAI, lm_stack: Stack) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "tell a story"}]
    three = client.chat.completions.create(model=LM, messages=messages, max_tokens=10, seed=5, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) == 3, texts  # three samples, not one copied
    again = client.chat.completions.create(model=LM, messages=messages, max_tokens=10, seed=5, n=3)
    assert [c.message.content for c in again.choices] == texts  # the same three, each time
    # choice j samples as the same call with n=1 and seed 5 + j does
    ones = [client.chat.completions.create(model=LM, messages=messages, max_tokens=10, seed=5 + j) for j in range(3)]
    assert [o.choices[0].message.content for o in ones] == texts
    assert three.usage is not None and all(o.usage is not None for o in ones)
    # usage as OpenAI and vLLM count it: the one prompt once, every choice's completion
    one = ones[0].usage
    assert one is not None and three.usage.prompt_tokens == one.prompt_tokens
    assert three.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones if o.usage)
    batch = client.completions.create(model=LM, prompt=["first prompt", "second prompt"], max_tokens=6, n=2, seed=9)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model=LM, prompt="second prompt", max_tokens=6, n=2, seed=9)
    assert [c.text for c in batch.choices[2:]] == [c.text for c in alone.choices]  # prompt-major, as OpenAI's
    first = client.completions.create(model=LM, prompt="first prompt", max_tokens=6, seed=9)
    assert batch.usage is not None and alone.usage is not None and first.usage is not None
    assert batch.usage.prompt_tokens == first.usage.prompt_tokens + alone.usage.prompt_tokens  # each prompt once


def test_n_out_of_range_is_a_400(lm_stack: Stack) -> None:
    url = lm_stack.url + "/v1/chat/completions"
    base: dict[str, Any] = {"model": LM, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with requests.Session() as http:
        for body, needle in (({**base, "n": 0}, "'n' must be an integer from 1 to 16"),
                             ({**base, "n": 17}, "'n' must be an integer from 1 to 16"),
                             ({**base, "n": "2"}, "'n' must be an integer")):
            r = http.post(url, json=body, timeout=30)
            assert r.status_code == 400, r.text
            assert needle in r.json()["error"]["message"], r.json()
        r = http.post(lm_stack.url + "/v1/completions", timeout=30,
                      json={"model": LM, "prompt": ["a"] * 60, "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and "prompts times 'n'" in r.json()["error"]["message"], r.text


def joined(chunks: list[Any], chat: bool) -> dict[int, str]:
    """Each choice's text, its chunks joined by their ``index`` (as a client joins a stream of several choices)."""
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts


def test_n_choices_stream_each_under_its_index_as_without_stream(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "tell a story"}]
    whole = client.chat.completions.create(model=LM, messages=messages, max_tokens=10, seed=5, n=3)
    chunks = list(client.chat.completions.create(model=LM, messages=messages, max_tokens=10, seed=5, n=3,
                                                 stream=True, stream_options={"include_usage": True}))
    assert joined(chunks, chat=True) == {c.index: c.message.content for c in whole.choices}
    roles = [ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]  # each choice opens with its role
    finishes = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # each prompt counted once
    assert all(c.usage is None for c in chunks[:-1])
    # several prompts, n each: prompt-major indices, the same texts as without stream
    batch = client.completions.create(model=LM, prompt=["first prompt", "second prompt"], max_tokens=6, n=2, seed=9)
    streamed = list(client.completions.create(model=LM, prompt=["first prompt", "second prompt"], max_tokens=6,
                                              n=2, seed=9, stream=True, stream_options={"include_usage": True}))
    assert joined(streamed, chat=False) == {c.index: c.text for c in batch.choices}
    assert streamed[-1].usage == batch.usage


def test_logprobs_and_echo_stream_whole_in_each_choices_last_chunk(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=LM, messages=messages, max_tokens=8, seed=3, n=2, logprobs=True,
                                           top_logprobs=2)
    chunks = list(client.chat.completions.create(model=LM, messages=messages, max_tokens=8, seed=3, n=2,
                                                 logprobs=True, top_logprobs=2, stream=True))
    for choice in whole.choices:
        mine = [ch for c in chunks for ch in c.choices if ch.index == choice.index]
        with_logprobs = [ch for ch in mine if ch.logprobs is not None]
        assert len(with_logprobs) == 1 and with_logprobs[0].finish_reason is not None  # the last chunk
        last, expected = with_logprobs[0].logprobs, choice.logprobs
        assert last is not None and expected is not None
        assert last.model_dump() == expected.model_dump()  # (the chunk's logprobs are a class of their own)
        assert "".join(ch.delta.content or "" for ch in mine) == choice.message.content
    # completions: echo puts the prompt first, as without stream; logprobs cover prompt and completion
    kwargs: dict[str, Any] = {"model": LM, "prompt": "the cat sat", "max_tokens": 6, "temperature": 0,
                              "echo": True, "logprobs": 1}
    plain = client.completions.create(**kwargs)
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert joined(streamed, chat=False) == {0: plain.choices[0].text}
    assert streamed[0].choices[0].text == "the cat sat"
    assert plain.choices[0].logprobs is not None
    assert [ch.logprobs.model_dump() for c in streamed for ch in c.choices if ch.logprobs] == [
        plain.choices[0].logprobs.model_dump()]
    scored = list(client.completions.create(**{**kwargs, "max_tokens": 0}, stream=True))  # scoring, streamed
    assert joined(scored, chat=False) == {0: "the cat sat"}


def test_completion_logprobs_and_echo_in_openais_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(model=LM, prompt="the cat sat", max_tokens=6, temperature=0, logprobs=2)
    choice, usage = r.choices[0], r.usage
    lp = choice.logprobs
    assert lp is not None and usage is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == usage.completion_tokens and "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob is not None and logprob < 0 and len(top) == 2
        assert max(top, key=lambda k: top[k]) == token  # greedy: the token taken is the likeliest
    # echo with max_tokens 0 scores a given text, as log-likelihood harnesses ask
    scored = client.completions.create(model=LM, prompt="the cat sat", max_tokens=0, echo=True, logprobs=1)
    s = scored.choices[0]
    assert s.text == "the cat sat" and s.logprobs is not None and s.logprobs.tokens is not None
    assert "".join(s.logprobs.tokens) == "the cat sat" and s.logprobs.token_logprobs is not None
    assert s.logprobs.token_logprobs[0] is None and all(v is not None for v in s.logprobs.token_logprobs[1:])
    again = client.completions.create(model=LM, prompt="the cat sat", max_tokens=0, echo=True, logprobs=1)
    assert again.choices[0].logprobs == s.logprobs  # sim-lm's values are deterministic
    echoed = client.completions.create(model=LM, prompt="the cat sat", max_tokens=6, temperature=0, echo=True,
                                       logprobs=0)
    e = echoed.choices[0]
    assert e.text == "the cat sat" + choice.text and e.logprobs is not None and e.logprobs.tokens is not None
    assert e.logprobs.tokens[3:] == lp.tokens and e.logprobs.token_logprobs is not None
    assert e.logprobs.token_logprobs[3:] == lp.token_logprobs
    plain = client.completions.create(model=LM, prompt="the cat sat", max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == choice.text


def test_chat_logprobs_in_openais_shape(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=LM, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
    none = client.chat.completions.create(model=LM, messages=messages, max_tokens=5, temperature=0, logprobs=True)
    assert none.choices[0].logprobs is not None and none.choices[0].logprobs.content is not None
    assert all(t.top_logprobs == [] for t in none.choices[0].logprobs.content)


def test_logprobs_and_echo_out_of_range_are_a_400(lm_stack: Stack) -> None:
    chat: dict[str, Any] = {"model": LM, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    completion: dict[str, Any] = {"model": LM, "prompt": "x", "max_tokens": 2}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "needs 'logprobs': true"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "from 0 to 20"),
        ("/v1/chat/completions", {**chat, "logprobs": 1}, "must be true or false"),
        ("/v1/chat/completions", {**chat, "echo": True}, "/v1/completions parameter"),
        ("/v1/completions", {**completion, "logprobs": 6}, "from 0 to 5"),
        ("/v1/completions", {**completion, "echo": "yes"}, "'echo' must be true or false"),
        ("/v1/completions", {**completion, "max_tokens": 0}, "0 only with 'echo'"),
    ]
    with requests.Session() as http:
        for path, body, needle in cases:
            r = http.post(lm_stack.url + path, json=body, timeout=30)
            assert r.status_code == 400, (path, body, r.text)
            assert needle in r.json()["error"]["message"], (body, r.json())


def test_hf_causal_logprobs_are_the_models_own(tmp_path: Path) -> None:
    """hf-causal's logprobs (generated and echoed) against a direct forward pass of the same tiny model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from gpu_worker.backends.hf_causal import HFCausalBackend
    from harness.models import build_tiny_llama

    folder = build_tiny_llama(tmp_path / "m")
    backend = HFCausalBackend("tiny", str(folder), "cpu", 8, 64)
    try:
        prompt = "the cat sat on the mat"
        greedy, sampled, scored = generated(backend.run([prompt] * 3, [
            SamplingParams(max_tokens=6, temperature=0, logprobs=3),
            SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=2, echo=True),
            SamplingParams(max_tokens=0, echo=True, logprobs=1)]))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        prompt_ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():  # the greedy continuation, straight from the model (a random model's bytes
            # need not decode and encode back to the same ids, so the ids are taken from generate())
            out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        greedy_ids = out[0, len(prompt_ids):].tolist()

        def expected(ids: list[int]) -> Any:
            with torch.no_grad():
                return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)

        def check(entries: list[dict[str, Any]], ids: list[int], first: int) -> None:
            assert len(entries) == len(ids) - first, (len(entries), len(ids), first)
            want = expected(ids)
            for t, entry in zip(range(first, len(ids)), entries):
                if t == 0:
                    assert entry["logprob"] is None and entry["top"] is None
                    continue
                assert entry["logprob"] == pytest.approx(float(want[t - 1, ids[t]]), abs=1e-4)
                best = torch.topk(want[t - 1], len(entry["top"]))
                assert [lp for _, lp in entry["top"]] == pytest.approx(best.values.tolist(), abs=1e-4)
                assert [tok for tok, _ in entry["top"]] == [tokenizer.decode([k]) for k in best.indices.tolist()]

        check(greedy.logprobs or [], prompt_ids + greedy_ids, len(prompt_ids))  # generated, greedy
        check(scored.prompt_logprobs or [], prompt_ids, 0)  # a given text scored (echo, max_tokens 0)
        check(sampled.prompt_logprobs or [], prompt_ids, 0)  # echoed beside a sampled completion
        assert len(sampled.logprobs or []) == sampled.completion_tokens and sampled.prompt == prompt
        assert scored.text == "" and scored.prompt == prompt and scored.completion_tokens == 0
        # greedy: each generated token is the likeliest at its position
        assert all(e["top"][0][1] == pytest.approx(e["logprob"], abs=1e-6) for e in greedy.logprobs or [])
    finally:
        backend.close()


def test_no_field_is_silently_ignored(client: openai.OpenAI) -> None:
    """An unknown field (sent as the openai client sends any field it does not type: extra_body) and a refused
    one are a 400 naming them; the fields that carry no behaviour here, and the honoured ones, are accepted."""
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
    for create, kwargs in ((client.chat.completions.create, {"messages": messages}),
                           (client.completions.create, {"prompt": "hello"})):
        with pytest.raises(openai.BadRequestError) as unknown:
            create(model=LM, max_tokens=4, extra_body={"foo": 1}, **kwargs)
        assert isinstance(unknown.value.body, dict) and "unknown field 'foo'" in unknown.value.body["message"]
    for refused in ({"reasoning_effort": "low"}, {"audio": {"voice": "alloy", "format": "wav"}}):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=LM, messages=messages, max_tokens=4, **refused)
        assert isinstance(error.value.body, dict), error.value.body
        assert f"'{next(iter(refused))}' is not supported here" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="at most 300 token ids"):
        client.chat.completions.create(model=LM, messages=messages, max_tokens=4,
                                       logit_bias={str(i): 1 for i in range(301)})
    answer = client.chat.completions.create(
        model=LM, messages=messages, max_tokens=6, seed=3, logit_bias={"5": -100, "17": 3}, presence_penalty=0.5,
        frequency_penalty=-0.5, user="u1", safety_identifier="h1", metadata={"team": "search"}, store=False,
        prompt_cache_key="user-1")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.service_tier is None  # none asked
    completion = client.completions.create(model=LM, prompt="hello", max_tokens=4, presence_penalty=1,
                                           frequency_penalty=1, logit_bias={"5": 10}, user="u1")
    assert completion.choices[0].text is not None


def test_the_answer_says_its_service_tier_and_usage_its_cached_tokens(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "you answer briefly " * 60}, {"role": "user", "content": "hello"}]
    tiers = {tier: client.chat.completions.create(model=LM, messages=messages, max_tokens=4, seed=1,
                                                  service_tier=tier).service_tier
             for tier in ("auto", "default", "flex", "priority")}
    assert tiers == {"auto": "default", "default": "default", "flex": "flex", "priority": "priority"}
    with pytest.raises(openai.BadRequestError, match="'service_tier' must be"):
        client.chat.completions.create(model=LM, messages=messages, max_tokens=4, service_tier="scale")
    for _ in range(2):  # the second call's prompt start is in the worker's prefix cache, if it keeps one
        answer = client.chat.completions.create(model=LM, messages=messages, max_tokens=4, seed=1)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 <= cached <= answer.usage.prompt_tokens
    completion = client.completions.create(model=LM, prompt="hello there", max_tokens=4,
                                           extra_body={"service_tier": "flex"})  # (not in its request type)
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens is not None
    assert completion.model_extra is not None and completion.model_extra.get("service_tier") == "flex"
    chunks = list(client.chat.completions.create(model=LM, messages=messages, max_tokens=4, seed=1, stream=True,
                                                 stream_options={"include_usage": True}, service_tier="auto"))
    assert {c.service_tier for c in chunks} == {"default"}  # every chunk says it, as OpenAI's do
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
