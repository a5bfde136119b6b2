"""sim-lm's prefix cache from outside: a tenant's long system prompt, prefilled by its first call, is found cached
by the next calls that start with it (after the first call ended), and the worker says so in its heartbeat, in
``llmb-admin workers`` and on /metrics."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.harness.stack import Stack, running_stack, wait_for

LM = "sim-lm"
SYSTEM = "You answer questions about the travel policy of a company. " * 60  # about 600 tokens


@pytest.fixture(scope="module")
def lm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("prefix")), workers=[(0, {"backend": "sim-lm"})],
                       web_workers=1) as s:
        yield s


def beat(stack: Stack) -> dict[str, int]:
    (info,) = [w for w in stack.fleet().values() if w["model"] == LM]
    return {k: int(info.get(k) or 0) for k in ("prefix_queries", "prefix_hits", "cached_blocks")}


def test_a_system_prompt_is_prefilled_once_and_found_cached_by_later_calls(lm_stack: Stack) -> None:
    with requests.Session() as http:
        def chat(question: str) -> None:
            r = http.post(lm_stack.url + "/v1/chat/completions", timeout=30, json={
                "model": LM, "max_tokens": 4, "messages": [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": question}]})
            assert r.status_code == 200, r.text

        chat("May I fly business class?")
        wait_for(lambda: beat(lm_stack)["prefix_queries"] > 0, 20, "a heartbeat with the first look-up")
        first = beat(lm_stack)
        assert first["prefix_hits"] == 0 and first["cached_blocks"] >= first["prefix_queries"] > 30
        for question in ("What about trains?", "And hotels?"):
            chat(question)  # each one after the last has ended: only the cache can hold the prefix now
        # (the questions' own whole pages, if any, differ: a page or so each way)
        wait_for(lambda: beat(lm_stack)["prefix_queries"] >= 3 * first["prefix_queries"] - 4, 20, "two more look-ups")
        after = beat(lm_stack)
        # every whole page of the shared start is found cached; only the pages with the question differ
        assert after["prefix_hits"] >= 2 * (first["prefix_queries"] - 2), (first, after)
        rate = f"{after['prefix_hits'] / after['prefix_queries']:.0%}"
        assert rate in lm_stack.admin("workers").stdout
        (listed,) = json.loads(lm_stack.admin("workers", "--json").stdout)
        assert listed["prefix_hits"] >= after["prefix_hits"] and listed["cached_blocks"] > 0
        metrics = http.get(lm_stack.url + "/metrics", timeout=10).text
        hits = [line for line in metrics.splitlines() if line.startswith("llmb_prefix_cache_hits_total{")]
        assert hits and f'model="{LM}"' in hits[0] and float(hits[0].rsplit(" ", 1)[1]) >= after["prefix_hits"]
        assert any(line.startswith("llmb_prefix_cache_blocks{") for line in metrics.splitlines())
