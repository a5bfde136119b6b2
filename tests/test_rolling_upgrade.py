"""Rolling upgrades that fail no call (issue 45, item 4).

* Under steady load from pooled clients (interactive /v1/infer and completions, one streamed chat call at a time,
  Batch API jobs), every process of the system is replaced one at a time as a rollout does (harness/rollout.py):
  gunicorn by SIGHUP and as a pod is replaced (a new server, the old one out of the Service, a preStop wait,
  SIGTERM), the active batcher then the standby, each gpu-worker (the one sim-lm worker included: its calls wait
  for the replacement) and the jobs runner. No call fails, none meets a connection error, none is answered more
  than a second past its deadline, no stream is cut without a resume, no batch line runs twice.
* A message-format change between versions: the messages between processes (the request a web app publishes, the
  batch a batcher sends, an item's result) carry a format version, and this version reads the previous format
  and the next one. The old and next encodings are made from the real encoder (a field stripped, unknown ones
  and the next ``v`` added) and run through the real batcher and worker; what this version writes is read by the
  previous version's readers (copied below as they were).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

from harness.helpers import decoded, expected
from harness.rollout import run_rollout
from harness.stack import Stack, running_stack, wait_for
from tasks.schema import (
    FORMAT_VERSION,
    NO_PARAMS,
    Batch,
    BatchItem,
    InferenceRequest,
    Item,
    ItemResult,
    Priority,
    SamplingParams,
)

pytestmark = pytest.mark.fault


# -- the whole rollout under load ------------------------------------------------------------------------
def test_a_rolling_upgrade_of_every_process_under_load_fails_no_call(tmp_path: Path) -> None:
    report = run_rollout(tmp_path, rate=30.0, aio_rate=5.0, embed=False, warm_s=2.0, sim_batch_ms=100)
    summary = report.summary()
    print(f"\n[rolling upgrade] {summary}\n  failed or late by step: {report.failures_by_step()}", flush=True)
    print(report.explain(tmp_path), flush=True)
    assert summary["calls"] > 1000 and summary["streams"] > 5 and summary["jobs"] >= 1, summary
    assert summary["failed"] == 0, summary
    assert summary["connection_errors"] == 0, summary
    assert summary["late"] == 0, summary
    assert summary["streams_cut_not_resumed"] == 0, summary
    assert summary["job_lines_run_twice"] == 0 and summary["job_lines_failed"] == 0, summary
    assert {"web-sighup", "web", "batcher", "gpu-worker", "jobs"} <= summary["drain_s"].keys(), summary
    assert len(summary["drain_s"]["gpu-worker"]) == 4 and len(summary["drain_s"]["batcher"]) == 2, summary


# -- message formats: the previous version's readers, as they were (format 1) -------------------------
def format1_batch(d: dict[str, Any]) -> Batch:
    """Batch.from_dict of the version before format versions: every item key taken as a field."""
    return Batch(
        id=str(d["id"]), model=str(d["model"]), created_at=float(d["created_at"]),
        items=tuple(BatchItem(**{**i, "died_on": tuple(i.get("died_on") or ()),
                                 "params": SamplingParams.from_dict(i.get("params") or {}),
                                 "priority": Priority(i.get("priority", Priority.INTERACTIVE))})
                    for i in d["items"]),
        parent_id=d.get("parent_id"), attempt=int(d.get("attempt", 0)), trace=d.get("trace"))


def format1_result(d: dict[str, Any]) -> ItemResult:
    """ItemResult.from_dict of the version before format versions."""
    return ItemResult(**d)


def wire(d: dict[str, Any]) -> dict[str, Any]:
    """As it travels (JSON), so that a reader sees what it would see."""
    return dict(json.loads(json.dumps(d)))


def a_batch(texts: list[str], reply_to: str = "nobody") -> Batch:
    now = time.time()
    return Batch(f"b-{uuid.uuid4().hex}", "sim", tuple(
        BatchItem(f"i-{uuid.uuid4().hex}", "r", t, now + 30, now, reply_to, params=SamplingParams(max_tokens=4))
        for t in texts), now)


def test_the_previous_versions_readers_read_what_this_version_writes() -> None:
    batch = a_batch(["x", "y"])
    assert format1_batch(wire(batch.to_dict())) == batch  # its "v" is at the top, where format 1 ignored keys
    result = ItemResult(output="sim:1", batch_id="b", batch_size=2, worker="gpu0@h", started_at=1.0, run_ms=2.0)
    assert format1_result(wire(result.to_dict())) == result  # no "v" in results yet (format 3 adds it)
    request = InferenceRequest("r", "t", "sim", (Item("i", "x"),), 1.0, 2.0, "ch")
    assert wire(request.to_dict())["v"] == FORMAT_VERSION


def test_this_version_reads_the_previous_and_the_next_format_and_refuses_beyond() -> None:
    batch = a_batch(["x"])
    old = wire(batch.to_dict())
    del old["v"]
    assert Batch.from_dict(old) == batch
    nxt = wire(batch.to_dict()) | {"v": FORMAT_VERSION + 1, "shard": 3}
    nxt["items"] = [i | {"lora_rank": 8} for i in nxt["items"]]
    assert Batch.from_dict(nxt) == batch
    result = ItemResult(output="o", worker="w")
    assert ItemResult.from_dict(wire(result.to_dict()) | {"v": FORMAT_VERSION + 1, "energy_j": 1.5}) == result
    assert ItemResult.from_dict({"output": "o"}) == ItemResult(output="o")  # new fields missing: defaults
    with pytest.raises(ValueError, match="format"):
        Batch.from_dict(wire(batch.to_dict()) | {"v": FORMAT_VERSION + 2})
    with pytest.raises(ValueError, match="format"):
        InferenceRequest.from_dict(wire(InferenceRequest("r", "t", "m", (Item("i", "x"),), 1.0, 2.0, "c").to_dict())
                                   | {"v": FORMAT_VERSION + 2})


# -- ... and through the real batcher and worker ----------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("formats")), workers=[0], web_workers=None, ready=False,
                       sim_batch_ms=50) as s:
        wait_for(lambda: s.fleet().get("gpu0@test", {}).get("state") == "idle", 60, "gpu0 serving")
        yield s


def result_of(stack: Stack, item_id: str) -> ItemResult:
    key = f"{stack.namespace}:result:{item_id}"
    wait_for(lambda: stack.redis.exists(key), 30, f"a result for {item_id}")
    return ItemResult.from_dict(json.loads(decoded(stack.redis.get(key) or b"")))


def request_message(texts: list[str]) -> tuple[dict[str, Any], list[Item]]:
    """A request as this version's web app encodes it (the real encoder), and its items."""
    now = time.time()
    items = [Item(f"i-{uuid.uuid4().hex}", t) for t in texts]
    request = InferenceRequest(f"r-{uuid.uuid4().hex}", "formats", "sim", tuple(items), now, now + 30,
                               "llmb-test-nobody", params=NO_PARAMS)
    return wire(request.to_dict()), items


@pytest.mark.parametrize("version", ["previous", "next"])
def test_a_request_of_the_previous_or_next_format_is_run_by_this_batcher_and_worker(stack: Stack,
                                                                                   version: str) -> None:
    body, items = request_message([f"req-{version}-{n}" for n in range(3)])
    if version == "previous":  # format 1: no "v", and none of the fields that have defaults
        for key in ("v", "weight", "priority", "params"):
            body.pop(key, None)
    else:  # the next format: its "v", and fields this version does not know, at every level
        body |= {"v": FORMAT_VERSION + 1, "region": "eu"}
        body["items"] = [i | {"modality": "text"} for i in body["items"]]
        body["params"] = {"future_knob": 1}
    from tasks.broker.queues import request_queue

    queue = request_queue(f"{stack.namespace}.requests")
    with Connection(stack.broker_url) as conn:
        conn.Producer().publish(json.dumps({"requests": [body]}), exchange="", routing_key=queue.name,
                                declare=[queue], content_type="application/json", content_encoding="utf-8")
    for item in items:
        assert result_of(stack, item.id).output == expected(item.input)


@pytest.mark.parametrize("version", ["previous", "next"])
def test_a_batch_of_the_previous_or_next_format_is_run_by_this_worker(stack: Stack, version: str) -> None:
    from tasks.broker.celery_app import RUN_BATCH, make_celery
    from tasks.config import Settings

    batch = a_batch([f"batch-{version}-{n}" for n in range(3)])
    body = wire(batch.to_dict())
    if version == "previous":
        del body["v"]
        body["items"] = [{k: v for k, v in i.items() if k not in ("died_on", "priority", "retries")}
                         for i in body["items"]]
    else:
        body |= {"v": FORMAT_VERSION + 1, "placement": "rack-2"}
        body["items"] = [i | {"modality": "text"} for i in body["items"]]
    app = make_celery(Settings.from_env(stack.env))
    app.send_task(RUN_BATCH, args=[body], queue=stack.fleet()["gpu0@test"]["queue"], task_id=batch.id)
    for item in batch.items:
        assert result_of(stack, item.id).output == expected(item.input)
