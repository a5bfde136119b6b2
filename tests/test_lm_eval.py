"""lm-evaluation-harness, the tool people score models with, run against this service and against the same model
in process: a multiple-choice task scored by log-likelihood must come out the same both ways.

lm-eval's ``local-completions`` model scores a choice by sending context + choice to /v1/completions with
``echo: true, max_tokens: 1, logprobs: 1`` and summing the echoed ``token_logprobs`` after the context's tokens
(it counts those with its own copy of the tokenizer, so the server must tokenize the text it gets back into the
same tokens). The service does not take token-id prompts, so it runs with ``tokenized_requests=False``: lm-eval
decodes its tokens to text and the hf-causal worker tokenizes that again (8 prompts a call: ``batch_size=8``). Its
``hf`` model (which needs ``accelerate``, lm-eval's ``hf`` extra) scores the same pairs with a forward pass of its
own. The tiny model (random weights, built offline) makes arbitrary predictions, but
the same arbitrary predictions both ways: the per-choice log-likelihoods are compared, to 1e-4 (fp32 on the CPU;
the worker scores each text alone, lm-eval's ``hf`` in padded batches).

The task is defined here: a YAML and a JSONL dataset written to a temporary folder, loaded with the ``json``
builder of ``datasets`` (no download; the HF_*_OFFLINE variables are set before lm-eval is imported). Each
question's right answer is the tiny model's greedy next token, so it is the likeliest choice by construction
(any other choice's first token is less likely, and each further token only lowers its sum): accuracy is 1.0
both ways, and lm-eval's ``is_greedy`` flag is true for it, which reads the ``top_logprobs`` the service sends.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.models import build_tiny_llama
from harness.stack import Stack, running_stack, wait_for
from tasks.store.models import RequestRecord, make_engine

for _offline in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_offline] = "1"  # before datasets and transformers are imported (they read these at import)

if os.environ.get("CI"):  # CI installs the test and models extras: a missing one is a failure, not a skip
    import accelerate  # noqa: F401  (lm-eval's hf model imports it)
    import lm_eval
    import lm_eval.tasks
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="bin/test installs the 'models' extra these tests need")
    transformers = pytest.importorskip("transformers", reason="bin/test installs the 'models' extra")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (lm-eval[hf])")
    lm_eval = pytest.importorskip("lm_eval", reason="bin/test installs the 'test' extra these tests need")
    pytest.importorskip("lm_eval.tasks")

LM = "tiny-llama"  # the worker serves the model under its folder's name
TASK = "llmb_tiny_choice"
DOCS, CHOICES = 12, 4
TOLERANCE = 1e-4  # absolute, per choice's log-likelihood (a sum over its tokens)
WORDS = ["the", "cat", "sat", "on", "a", "mat", "batch", "model", "token", "queue", "fast", "slow", "red", "blue",
         "worker", "request", "answer", "hello", "world"]
DISTRACTORS = [" mat", " queue red", " hello world fast", " the cat sat on", " blue", " worker request"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(Path(tmp_path_factory.mktemp("lm-eval-model")) / LM)


@pytest.fixture(scope="module")
def stack(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("lm-eval")), workers=[(0, {"backend": "hf-causal",
                                                                               "model": str(folder)})],
                       web_workers=1, max_tokens_cap=64) as s:
        yield s


def questions(folder: Path) -> list[dict[str, Any]]:
    """DOCS questions whose right choice is the model's greedy next token after the context. Only tokens that
    come back as themselves are used: their text re-tokenized after the context gives the context's tokens and
    that one token (a random model also predicts half characters and merges that would not)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    rng = random.Random(7)
    docs: list[dict[str, Any]] = []
    for _ in range(400):
        context = f"Question: {' '.join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))}\nAnswer:"
        ids = tokenizer(context)["input_ids"]
        with torch.no_grad():
            best = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        text = str(tokenizer.decode([best]))
        if best in tokenizer.all_special_ids or "\ufffd" in text or tokenizer(context + text)["input_ids"] != \
                [*ids, best] or text in DISTRACTORS:
            continue
        answer = len(docs) % CHOICES  # the right choice's place moves from question to question
        others = [DISTRACTORS[(len(docs) + k) % len(DISTRACTORS)] for k in range(CHOICES - 1)]
        docs.append({"context": context, "choices": [*others[:answer], text, *others[answer:]], "answer": answer})
        if len(docs) == DOCS:
            return docs
    raise AssertionError(f"only {len(docs)} questions with a greedy token that tokenizes back to itself")


@pytest.fixture(scope="module")
def task_folder(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task's YAML (written as JSON, which YAML reads) and its JSONL dataset, both local."""
    where = Path(tmp_path_factory.mktemp("lm-eval-task"))
    data = where / "questions.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in questions(folder)))
    config = {"task": TASK, "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(where / "cache")},
              "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "context",
              "doc_to_choice": "choices", "doc_to_target": "answer", "target_delimiter": "",
              "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                              {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
              "metadata": {"version": 1.0}}
    (where / f"{TASK}.yaml").write_text(json.dumps(config, indent=1))
    return where


def evaluate(task_folder: Path, model: str, model_args: dict[str, Any]) -> dict[str, Any]:
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=8,
                                      task_manager=lm_eval.tasks.TaskManager(include_path=str(task_folder)),
                                      log_samples=True)
    assert results is not None
    return cast(dict[str, Any], results)


@pytest.fixture(scope="module")
def through_the_service(stack: Stack, folder: Path, task_folder: Path) -> dict[str, Any]:
    return evaluate(task_folder, "local-completions", {
        "model": LM, "base_url": stack.url + "/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(folder), "tokenized_requests": False, "max_length": 256,
        "max_retries": 1, "timeout": 60})  # one attempt each (tenacity's count): a failed call fails the run


@pytest.fixture(scope="module")
def in_process(folder: Path, task_folder: Path) -> dict[str, Any]:
    return evaluate(task_folder, "hf", {"pretrained": str(folder), "device": "cpu", "dtype": "float32"})


def scores(results: dict[str, Any]) -> dict[int, list[tuple[float, bool]]]:
    """Each document's (log-likelihood, is_greedy) per choice, from lm-eval's logged samples."""
    return {s["doc_id"]: [(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in results["samples"][TASK]}


def test_per_choice_log_likelihoods_agree(through_the_service: dict[str, Any], in_process: dict[str, Any]) -> None:
    served, local = scores(through_the_service), scores(in_process)
    assert sorted(served) == sorted(local) == list(range(DOCS))
    assert all(len(served[d]) == len(local[d]) == CHOICES for d in served)
    differences = [abs(a[0] - b[0]) for d in served for a, b in zip(served[d], local[d])]
    assert max(differences) <= TOLERANCE, f"max |served - in process| = {max(differences):.3g} over " \
                                          f"{len(differences)} choices"
    assert all(ll < 0 for d in served for ll, _ in served[d])
    assert {d: [g for _, g in served[d]] for d in served} == {d: [g for _, g in local[d]] for d in local}


def test_accuracy_agrees_and_the_greedy_choice_wins(through_the_service: dict[str, Any],
                                                    in_process: dict[str, Any]) -> None:
    served, local = through_the_service["results"][TASK], in_process["results"][TASK]
    assert served["acc,none"] == local["acc,none"] == 1.0, (served, local)
    assert served["acc_norm,none"] == local["acc_norm,none"], (served, local)
    for sample in through_the_service["samples"][TASK]:  # the right choice is the greedy one, and only it
        greedy = [g for (_, g), in sample["resps"]]
        assert greedy == [i == sample["target"] for i in range(CHOICES)], (sample["doc_id"], sample["resps"])


def test_every_choice_was_scored_by_the_worker_with_lm_evals_tokens(stack: Stack, folder: Path,
                                                                    through_the_service: dict[str, Any]) -> None:
    """One ledger item per (question, choice), asked as lm-eval asks, each prompt as many tokens as lm-eval's
    own tokenizer made of it: the text it decoded was tokenized back into the same tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompts = [s["doc"]["context"] + choice for s in through_the_service["samples"][TASK]
               for choice in s["doc"]["choices"]]
    with Session(make_engine(stack.database_url)) as s:
        query = select(RequestRecord).where(RequestRecord.model == LM, RequestRecord.status == "ok")
        wait_for(lambda: len(s.scalars(query).all()) >= len(prompts), 30, "every scored choice in the ledger")
        records = s.scalars(query).all()
    assert len(records) == DOCS * CHOICES == len(prompts)
    asked = [json.loads(r.params or "{}") for r in records]
    assert all(p["echo"] is True and p["logprobs"] == 1 and p["max_tokens"] == 1 and p["temperature"] == 0
               for p in asked), asked[0]
    assert sorted(r.prompt_tokens or 0 for r in records) == sorted(len(tokenizer(p)["input_ids"]) for p in prompts)
