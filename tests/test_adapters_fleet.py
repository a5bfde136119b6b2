"""LoRA adapters across a fleet of sim-lm workers, end to end: real RabbitMQ, Redis, batcher and worker processes.

Until adapters can be registered through the API (issue 44's registry part), calls name their adapter the way the
API will: the call's params carry ``adapter`` and ``adapter_path``, submitted through a gateway of this process's
own (as ``llmb-admin replay`` does). Checked: the heartbeats report resident adapters; items go to the worker
holding their adapter (one load per adapter, no replica at this load); no batch holds more than the cap of
distinct adapters; ``llmb-admin workers``, ``/metrics`` and the batches' names show them."""
from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.stack import Stack, running_stack, wait_for
from tasks.broker.consumer import batch_label
from tasks.cli.main import Admin
from tasks.config import Settings
from tasks.gateway.calls import Call
from tasks.gateway.gateway import Gateway
from tasks.schema import Batch, BatchItem, SamplingParams

ADAPTERS = ("sales", "legal", "support", "hr")
CAP = 2  # distinct adapters per batch and per step


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("adapters"))
    with running_stack(tmp, web_workers=1, workers=[(d, {"backend": "sim-lm"}) for d in range(3)],
                       sim_lm_speed=10, max_adapters=4, max_adapters_per_batch=CAP, heartbeat_interval_s=0.25,
                       heartbeat_stale_factor=8) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> Gateway:
    gateway = Admin(Settings.from_env(stack.env)).gateway()
    assert gateway.live_workers(fresh=True)  # the fleet read once before calls come in together
    return gateway


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    dirs = {}
    for i, name in enumerate(ADAPTERS):
        path = tmp_path_factory.mktemp(name)
        (path / "adapter_config.json").write_text(json.dumps({"r": 8 << i, "target_modules": ["q_proj", "v_proj"]}))
        dirs[name] = str(path)
    return dirs


def call(gateway: Gateway, adapter: str | None, path: str | None, i: int) -> str:
    """One call of ``adapter`` (None: the base model); its request id."""
    rid = uuid.uuid4().hex
    params = SamplingParams(max_tokens=8, temperature=0, adapter=adapter, adapter_path=path)
    answer = gateway.submit(Call(request_id=rid, tenant=f"team-{adapter or 'base'}", model="sim-lm",
                                 inputs=(f"question {i} for {adapter}",), timeout_ms=60_000, params=params))
    assert answer.results[0].error is None, answer.results[0]
    return rid


def sim_lm(stack: Stack) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in stack.fleet().items() if v.get("model") == "sim-lm"}


def test_e2e_items_go_where_their_adapter_is_resident_and_batches_hold_at_most_the_cap(
        stack: Stack, gateway: Gateway, adapter_dirs: dict[str, str]) -> None:
    rids: dict[str, str] = {}
    with ThreadPoolExecutor(8) as pool:
        for wave in range(6):  # waves of concurrent calls, every adapter and the base model in each
            jobs = {pool.submit(call, gateway, a, adapter_dirs.get(a or ""), wave * 10 + j): a
                    for j, a in enumerate([*ADAPTERS, *ADAPTERS, None])}
            rids.update({f.result(): a or "" for f, a in jobs.items()})

    def settled() -> dict[str, dict[str, Any]] | None:
        beats = sim_lm(stack)
        return beats if sum(len(b["adapters"]) for b in beats.values()) >= len(ADAPTERS) else None

    beats = wait_for(settled, 10, "heartbeats reporting the adapters")
    holders = defaultdict(list)
    for wid, b in beats.items():
        assert b["max_adapters"] == 4 and not b["adapters_loading"]
        for name in b["adapters"]:
            holders[name].append(wid)
    assert set(holders) == set(ADAPTERS)
    # affinity: each adapter was loaded once, on one worker, and its later calls went there
    assert sum(b["adapter_loads"] for b in beats.values()) == len(ADAPTERS)
    assert all(len(w) == 1 for w in holders.values()), holders
    assert sum(b["adapter_evictions"] for b in beats.values()) == 0
    # the per-batch cap, from the ledger: which batch carried each call
    by_batch = batches_of(stack, rids)
    assert by_batch and max(len({a for a in adapters if a}) for adapters in by_batch.values()) <= CAP
    assert any(len({a for a in adapters if a}) == CAP for adapters in by_batch.values())  # the cap was reached


def batches_of(stack: Stack, rids: dict[str, str]) -> dict[str, list[str]]:
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from tasks.store.models import RequestRecord

    def read() -> dict[str, list[str]] | None:
        engine = create_engine(stack.database_url)
        try:
            with Session(engine) as session:
                rows = session.execute(select(RequestRecord.correlation_id, RequestRecord.batch_id)).all()
        finally:
            engine.dispose()
        found = {rid: batch for rid, batch in rows if rid in rids and batch}
        if len(found) < len(rids):
            return None
        out: dict[str, list[str]] = defaultdict(list)
        for rid, batch in found.items():
            out[batch].append(rids[rid])
        return dict(out)

    return wait_for(read, 15, "the ledger's record of every call")


def test_e2e_the_fleet_view_and_metrics_show_the_adapters(stack: Stack, gateway: Gateway,
                                                          adapter_dirs: dict[str, str]) -> None:
    call(gateway, "sales", adapter_dirs["sales"], 99)
    out = wait_for(lambda: o if "sales" in (o := stack.admin("workers").stdout) else None, 10,
                   "`llmb-admin workers` listing the adapters")
    assert "ADAPTERS" in out and "LOADS" in out and "EVICTED" in out
    metrics = requests.get(stack.url + "/metrics", timeout=10).text
    assert 'llmb_worker_adapters_resident{model="sim-lm"' in metrics
    assert "llmb_worker_adapter_loads_total" in metrics and "llmb_worker_adapter_evictions_total" in metrics
    assert 'llmb_adapter_items_total{adapter="sales"}' in metrics


def test_batch_names_say_their_adapters() -> None:
    items = tuple(BatchItem(id=f"i{n}", request_id="r", input="x", deadline=0.0, accepted_at=0.0, reply_to="r",
                            params=SamplingParams(adapter=a)) for n, a in enumerate(["b", "a", None, "b"]))
    assert batch_label(Batch(id="x", model="m", created_at=0.0, items=items)) == "batch of 4 for m (adapters: a, b)"
    many = tuple(BatchItem(id=f"i{n}", request_id="r", input="x", deadline=0.0, accepted_at=0.0, reply_to="r",
                           params=SamplingParams(adapter=f"a{n}")) for n in range(6))
    assert batch_label(Batch(id="x", model="m", created_at=0.0, items=many)).endswith("(adapters: a0, a1, a2, a3 +2)")
    assert batch_label(Batch(id="x", model="m", created_at=0.0, items=items[2:3])) == "batch of 1 for m"
