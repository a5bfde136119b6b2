"""sim-lm's prefix cache from outside: a tenant's long system prompt, prefilled by its first call, is found cached
by the next calls that start with it (after the first call ended), and the worker says so in its heartbeat, in
``llmb-admin workers`` and on /metrics."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.stack import Stack, running_stack, wait_for

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


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("routing")), web_workers=1,
                       workers=[(0, {"backend": "sim-lm"}), (1, {"backend": "sim-lm"})]) as s:
        yield s


def ran_on(stack: Stack, request_ids: list[str]) -> dict[str, str]:
    """The worker that ran each call, from the ledger (waited for: it is written after the answer)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from tasks.store.models import BatchRecord, RequestRecord, make_engine

    engine = make_engine(stack.database_url)
    found: dict[str, str] = {}

    def read() -> bool:
        with Session(engine) as s:
            rows = s.execute(select(RequestRecord.correlation_id, BatchRecord.worker)
                             .join(BatchRecord, BatchRecord.id == RequestRecord.batch_id)
                             .where(RequestRecord.correlation_id.in_(request_ids))).all()
        found.update({rid: worker for rid, worker in rows if worker})
        return len(found) == len(request_ids)

    wait_for(read, 20, "the calls' ledger rows")
    engine.dispose()
    return found


def test_a_tenants_later_calls_go_to_the_worker_whose_cache_holds_its_system_prompt(two_workers: Stack) -> None:
    """Sequential calls on an idle fleet: least backlog alone alternates the workers (the one sent to longest
    ago first), so without the routing a tenant's calls would land on both."""
    prompts = {t: f"Tenant {t}. " + SYSTEM for t in range(4)}
    with requests.Session() as http:
        def chat(rid: str, tenant: int, question: str) -> None:
            r = http.post(two_workers.url + "/v1/chat/completions", timeout=30, headers={"X-Request-Id": rid},
                          json={"model": LM, "max_tokens": 2, "messages": [
                              {"role": "system", "content": prompts[tenant]}, {"role": "user", "content": question}]})
            assert r.status_code == 200, r.text

        for t in range(4):
            chat(f"first-{t}", t, "hello?")
        later = []
        for q in range(3):
            for t in (3, 1, 0, 2):
                chat(f"q{q}-{t}", t, f"question {q}?")
                later.append((f"q{q}-{t}", t))
    where = ran_on(two_workers, [f"first-{t}" for t in range(4)] + [rid for rid, _ in later])
    assert len({where[f"first-{t}"] for t in range(4)}) == 2  # the first calls were spread over both
    assert {rid: where[rid] for rid, _ in later} == {rid: where[f"first-{t}"] for rid, t in later}
