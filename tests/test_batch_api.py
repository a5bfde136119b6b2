"""The Batch API end to end with the official `openai` client: real gunicorn, batcher, sim workers and `llmb-jobs`
processes, API keys on (files and batches belong to a tenant).

Workers: ``sim`` (50 ms batches, a poison trigger), ``slow`` (sim, 1 s batches: jobs that last long enough to be
cancelled or killed mid-way) and ``sim-lm`` (the OpenAI chat endpoint). Two ``llmb-jobs`` processes poll every
0.2 s with a 2 s lease, so a killed one's jobs are taken over by the other within seconds.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests
from sqlalchemy import func, inspect, select
from sqlalchemy.orm import Session

from harness.helpers import expected
from harness.stack import BROKER_URL, REDIS_URL, Stack, running_stack, wait_for
from tasks.store.models import BatchLineRecord, RequestRecord, make_engine

if os.environ.get("CI"):
    import openai
else:
    openai = pytest.importorskip("openai", reason="bin/test installs the test extra (the official openai client)")

if TYPE_CHECKING:
    from openai.types import Batch, BatchError, BatchRequestCounts

POISON = "__poison_line__"


@pytest.fixture(scope="module")
def jobs_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("batch_api"))
    with running_stack(tmp, workers=[0, (1, {"model": "slow", "sim_batch_ms": 1000}), (2, {"backend": "sim-lm"})],
                       web_workers=1, jobs=("jobs", "jobs2"), auth="keys", auth_cache_s=0.5, sim_batch_ms=50,
                       sim_raise_on=POISON, files_dir=tmp / "files", jobs_poll_s=0.2, jobs_lease_s=2,
                       jobs_line_timeout_ms=30_000, offline_max_wait_ms=100, sim_lm_speed=20) as s:
        yield s


def client(stack: Stack, tenant: str) -> openai.OpenAI:
    key = stack.admin("keys", "create", tenant).stdout.strip()
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def alice(jobs_stack: Stack) -> openai.OpenAI:
    return client(jobs_stack, "alice")


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(x) for x in lines).encode() + b"\n"


def infer_lines(texts: list[str], model: str | None = None) -> list[dict[str, Any]]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/infer",
             "body": {"input": t, **({"model": model} if model else {})}} for i, t in enumerate(texts)]


def create(c: openai.OpenAI, input_file_id: str, endpoint: str = "/v1/infer", **options: Any) -> Batch:
    """A batch of an uploaded file, to ``endpoint`` (the client's endpoint type lists OpenAI's routes, not this
    server's /v1/infer)."""
    return c.batches.create(input_file_id=input_file_id, endpoint=endpoint,  # type: ignore[arg-type]
                            completion_window="24h", **options)


def submit(c: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/infer") -> Batch:
    f = c.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return create(c, f.id, endpoint)


def counts(batch: Batch) -> BatchRequestCounts:
    """A batch's request counts (the client types them optional; this server always sends them)."""
    assert batch.request_counts is not None, batch
    return batch.request_counts


def batch_errors(batch: Batch) -> list[BatchError]:
    """A failed batch's errors (the client types them optional)."""
    assert batch.errors is not None and batch.errors.data is not None, batch
    return batch.errors.data


def finished(c: openai.OpenAI, batch_id: str, timeout_s: float = 60, states: tuple[str, ...] = (
        "completed", "failed", "cancelled", "expired")) -> Batch:
    found: list[Batch] = []

    def done() -> bool:
        found[:] = [c.batches.retrieve(batch_id)]
        return found[0].status in states

    wait_for(done, timeout_s, f"batch {batch_id} to end")
    return found[0]


def read(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


def ledger_runs(stack: Stack, batch_id: str) -> Counter[str]:
    """Submissions of each line of the batch the ledger holds (one ledger request per submission)."""
    with Session(make_engine(stack.database_url)) as s:
        rows = s.execute(select(RequestRecord.correlation_id, func.count()).where(
            RequestRecord.correlation_id.like(f"{batch_id}-%")).group_by(RequestRecord.correlation_id))
        return Counter({cid: int(n) for cid, n in rows})


def finished_lines(stack: Stack, batch_id: str) -> set[str]:
    """The lines the job has finished: its output rows committed (the ledger's correlation ids)."""
    with Session(make_engine(stack.database_url)) as s:
        line = BatchLineRecord
        return set(s.scalars(select(line.request_id).where(line.job_id == batch_id, line.status.in_(("ok", "error")))))


def test_a_batch_completes_with_one_output_or_error_per_line(jobs_stack: Stack, alice: openai.OpenAI) -> None:
    texts = [f"batch text {i}" for i in range(1000)]
    texts[557] = f"this one is {POISON}"
    batch = submit(alice, infer_lines(texts))
    assert batch.status == "validating" and batch.endpoint == "/v1/infer" and batch.completion_window == "24h"
    done = finished(alice, batch.id)
    assert done.status == "completed", done
    assert (counts(done).total, counts(done).completed, counts(done).failed) == (1000, 999, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at

    outputs, errors = read(alice, done.output_file_id), read(alice, done.error_file_id)
    assert len(outputs) == 999 and len(errors) == 1
    ids = Counter(x["custom_id"] for x in outputs + errors)
    assert set(ids) == {f"line-{i}" for i in range(1000)} and set(ids.values()) == {1}, "every custom_id once"
    for x in outputs:
        assert x["response"]["status_code"] == 200 and x["error"] is None and x["id"].startswith("batch_req_")
        assert x["response"]["body"]["output"] == expected(texts[int(x["custom_id"].split("-")[1])])
        assert x["response"]["request_id"] == x["response"]["body"]["id"]
    poison = errors[0]
    assert poison["custom_id"] == "line-557" and poison["response"]["status_code"] == 422
    assert poison["response"]["body"]["error"]["type"] == "poison_input"

    assert done.output_file_id is not None
    out_file = alice.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output" and out_file.bytes > 0

    # the ledger links every line to its batches: its request id is the ledger's correlation id
    wait_for(lambda: len(ledger_runs(jobs_stack, batch.id)) == 1000, 20, "every line in the ledger")
    shown = json.loads(jobs_stack.admin("jobs", "show", batch.id, "--lines", "1000", "--json").stdout)
    assert shown["status"] == "completed" and shown["lines_by_status"] == {"ok": 999, "error": 1}
    assert all(row["batches"] for row in shown["lines"]), "each line lists the batches that carried it"
    assert any(j["id"] == batch.id for j in json.loads(jobs_stack.admin("jobs", "list", "--json").stdout))


def test_lines_run_as_their_endpoint_would_and_invalid_ones_are_errors(jobs_stack: Stack,
                                                                       alice: openai.OpenAI) -> None:
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "sim-lm", "max_tokens": 8, "messages": [{"role": "user", "content": f"hi {i}"}]}}
             for i in range(10)]
    lines.append({"custom_id": "streamed", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "sim-lm", "stream": True, "messages": [{"role": "user", "content": "x"}]}})
    lines.append({"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "sim-lm"}})
    done = finished(alice, submit(alice, lines, "/v1/chat/completions").id)
    assert done.status == "completed" and counts(done).completed == 10 and counts(done).failed == 2
    outputs = read(alice, done.output_file_id)
    for x in outputs:
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        assert 1 <= body["usage"]["completion_tokens"] <= 8
    errors = {x["custom_id"]: x["response"] for x in read(alice, done.error_file_id)}
    assert errors["streamed"]["status_code"] == 400 and "stream" in errors["streamed"]["body"]["error"]["message"]
    assert errors["no-messages"]["status_code"] == 400
    assert set(errors["no-messages"]["body"]["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape

    bad = [*infer_lines(["a", "b"]), {"custom_id": "line-0", "method": "POST", "url": "/v1/infer", "body": {}},
           {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}]
    failed = finished(alice, submit(alice, bad).id)
    assert failed.status == "failed" and failed.output_file_id is None
    assert [(e.line, e.code) for e in batch_errors(failed)] == [(3, "duplicate_custom_id"), (4, "mismatched_endpoint")]


def test_files_and_batches_belong_to_their_tenant(jobs_stack: Stack, alice: openai.OpenAI) -> None:
    bob = client(jobs_stack, "bob")
    mine = alice.files.create(file=("a.jsonl", jsonl(infer_lines(["x"]))), purpose="batch")
    assert alice.files.retrieve(mine.id).filename == "a.jsonl"
    assert alice.files.content(mine.id).text == jsonl(infer_lines(["x"])).decode()
    batch = create(alice, mine.id)
    for attempt in (lambda: bob.files.retrieve(mine.id), lambda: bob.files.content(mine.id),
                    lambda: bob.files.delete(mine.id), lambda: bob.batches.retrieve(batch.id),
                    lambda: bob.batches.cancel(batch.id), lambda: create(bob, mine.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert batch.id not in {b.id for b in bob.batches.list()}
    assert mine.id not in {f.id for f in bob.files.list()}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=jobs_stack.url + "/v1", api_key="llmb_00000000_" + "x" * 43,
                      max_retries=0).batches.retrieve(batch.id)
    assert finished(alice, batch.id).status == "completed"

    # pages of the tenant's batches, newest first, the official client following the cursor
    more = [create(alice, mine.id).id for _ in range(3)]
    page = alice.batches.list(limit=2)
    assert [b.id for b in page.data] == more[::-1][:2] and page.has_more
    listed = [b.id for b in alice.batches.list(limit=2)]  # iterating a page follows `after` to the end
    assert listed[:4] == [*more[::-1], batch.id]
    assert alice.files.delete(mine.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(mine.id)
    for b in more:
        finished(alice, b, states=("completed", "failed"))


def test_cancel_stops_feeding_lets_running_lines_finish(jobs_stack: Stack, alice: openai.OpenAI) -> None:
    batch = submit(alice, infer_lines([f"cancel me {i}" for i in range(1000)], model="slow"))
    wait_for(lambda: counts(alice.batches.retrieve(batch.id)).completed >= 10, 30, "the first lines done")
    assert alice.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = finished(alice, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    ran, never = read(alice, done.output_file_id), read(alice, done.error_file_id)
    assert 10 <= len(ran) < 1000 and len(ran) == counts(done).completed
    assert {x["error"]["code"] for x in never} == {"batch_cancelled"} and len(ran) + len(never) == 1000
    assert set(Counter(x["custom_id"] for x in ran + never).values()) == {1}
    # the lines that were running finished; no line was sent after the cancel was seen
    ran_ids = {x["response"]["request_id"] for x in ran}
    wait_for(lambda: set(ledger_runs(jobs_stack, batch.id)) >= ran_ids, 20, "the finished lines in the ledger")
    assert set(ledger_runs(jobs_stack, batch.id)) == ran_ids
    with pytest.raises(openai.BadRequestError):
        alice.batches.cancel(finished(alice, submit(alice, infer_lines(["quick"])).id).id)  # completed: too late


def holder(stack: Stack, batch_id: str) -> str:
    """The name of the llmb-jobs process holding the job's lease (its owner id holds the process id)."""
    found: list[str] = []

    def held() -> bool:
        owner = json.loads(stack.admin("jobs", "show", batch_id, "--json").stdout)["lease_owner"] or ""
        found[:] = [n for n in ("jobs", "jobs2") if n in stack.procs and f":{stack.pid(n)}:" in owner]
        return bool(found)

    wait_for(held, 20, f"an llmb-jobs process to hold {batch_id}")
    return found[0]


def _streamed_chat(c: openai.OpenAI) -> tuple[float, str]:
    """One interactive streamed chat call: seconds until its last chunk, and its text."""
    started, text = time.monotonic(), ""
    for chunk in c.chat.completions.create(model="sim-lm", max_tokens=16, stream=True,
                                           messages=[{"role": "user", "content": "are you there?"}]):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    return time.monotonic() - started, text


def test_an_interactive_stream_beside_a_running_job_goes_first(jobs_stack: Stack, alice: openai.OpenAI) -> None:
    """The job's lines are offline: they fill what interactive calls leave, so a stream on the same device is
    not queued behind 600 lines (which take several times its length to run)."""
    idle = [_streamed_chat(alice)[0] for _ in range(3)]
    lines = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "sim-lm", "max_tokens": 64, "messages": [{"role": "user", "content": f"go {i}"}]}}
             for i in range(600)]
    batch = submit(alice, lines, "/v1/chat/completions")
    wait_for(lambda: counts(alice.batches.retrieve(batch.id)).completed >= 20, 30, "the job running")
    beside = []
    for _ in range(5):
        seconds, text = _streamed_chat(alice)
        assert text, "the stream got its text"
        beside.append(seconds)
    running = alice.batches.retrieve(batch.id)
    assert running.status == "in_progress", "the streams ran while the job had lines left"
    # a generous bound (a loaded 2-core CI host): the job's remaining work alone takes far longer than this
    assert max(beside) <= 3 * max(idle) + 1.0, (idle, beside)
    done = finished(alice, batch.id, timeout_s=120)
    assert done.status == "completed" and counts(done).completed == 600


@pytest.mark.fault
def test_llmb_jobs_sigkilled_mid_job_is_taken_over_and_runs_no_line_twice(jobs_stack: Stack,
                                                                          alice: openai.OpenAI) -> None:
    items_before = jobs_stack.items_done()
    batch = submit(alice, infer_lines([f"survive {i}" for i in range(400)], model="slow"))
    wait_for(lambda: counts(alice.batches.retrieve(batch.id)).completed >= 100, 30, "a quarter done")
    running = holder(jobs_stack, batch.id)
    jobs_stack.kill(running)  # SIGKILL: lines in flight are cut off, finished ones are committed
    at_kill = alice.batches.retrieve(batch.id)
    assert at_kill.status == "in_progress" and counts(at_kill).completed < 400
    other = holder(jobs_stack, batch.id)  # the other process takes the job over once the lease lapses
    assert other != running
    jobs_stack.start_jobs(running)  # and the killed one comes back (it finds the job held)
    # (a line the killed process had claimed its key for and not marked published is waited for: its answer when it
    # was published, else it runs once its deadline has passed: test_a_line_sent_again_never_runs_... below)
    done = finished(alice, batch.id, timeout_s=90)
    assert done.status == "completed" and counts(done).completed == 400
    outputs = read(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in outputs) == sorted(f"line-{i}" for i in range(400))
    for x in outputs:
        assert x["response"]["body"]["output"] == expected(f"survive {x['custom_id'].split('-')[1]}")
    # each line ran once: one ledger request (submission) per line, and the device answered 400 items, not more
    # (a line cut off in flight is sent again with its idempotency key: it gets the first run's answer)
    wait_for(lambda: len(ledger_runs(jobs_stack, batch.id)) == 400, 20, "every line in the ledger")
    runs = ledger_runs(jobs_stack, batch.id)
    assert set(runs.values()) == {1}, {k: n for k, n in runs.items() if n > 1}
    assert jobs_stack.items_done() - items_before == 400


class Device:
    """What a publish leads to, in place of RabbitMQ, a batcher and a worker: every item of every request published
    runs at once (its result written and its caller woken, as a worker's are), counted by request id."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.runs: Counter[str] = Counter()

    def publish(self, requests_: Any, timeout_s: float) -> None:
        for r in requests_:
            self.runs[r.id] += 1
            run(self.writer, r.id, [(i.id, i.input) for i in r.items], r.reply_to)


def run(writer: Any, request_id: str, items: list[tuple[str, str]], reply_to: str) -> None:
    """A worker's run of these items: their results written, their caller woken."""
    from tasks.schema import BatchItem, ItemResult

    now = time.time()
    writer.write([(BatchItem(item_id, request_id, text, now + 60, now, reply_to),
                   ItemResult(output=f"ran {text}", batch_id="b", batch_size=1, worker="w", started_at=now, run_ms=1.0))
                  for item_id, text in items])


def test_a_line_sent_again_never_runs_a_sending_killed_between_its_publish_and_its_mark_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind the SIGKILL test above, at the Redis level with the real gateway and line runner: the killed
    process had claimed a line's key, marked it being sent (``published: null``), published it, and died before
    marking it published, so its process holds no lease. The process that takes the job over waits for that
    sending instead of running the line again: its answer once its results are in (there already, or later); once
    its deadline has passed without one, that run ends 504 and the line's next run (a new key) runs it, once. A
    line whose process died before it was being sent (``published: false``) never ran: it runs at once."""
    import threading
    import uuid

    from tasks.config import Settings
    from tasks.policy.batchfile import idempotency_key, line_request_id
    from tasks.schema import WorkerInfo
    from tasks.state.records import Idempotency, Record, Shape
    from tasks.state.requests import Requests
    from tasks.state.results import ResultWriter
    from tasks.store.jobs import JobStore, Line
    from tasks.store.models import Base
    from webapp.jobs import LineRunner
    from webapp.services import Services

    settings = Settings.of(namespace=f"resend-{uuid.uuid4().hex[:8]}", redis_url=REDIS_URL, broker_url=BROKER_URL,
                        database_url=f"sqlite:///{tmp_path / 'llmb.db'}", result_recheck_ms=100,
                        jobs_line_timeout_ms=20_000)
    Base.metadata.create_all(make_engine(settings.stores.database_url))
    services = Services.from_settings(settings, door=False)  # as llmb-jobs builds them
    device = Device(ResultWriter.from_settings(settings, services.client))
    monkeypatch.setattr(services.publisher, "publish", device.publish)
    now = services.clock()
    services.fleet.beat(WorkerInfo(id="gpu0@test", queue="q", model="sim", max_batch=8, state="idle", outstanding=0,
                                   completed=1, batch_started_at=None, batch_ms_estimate=10.0, heartbeat_at=now + 600))
    job = JobStore.from_settings(settings).create("alice", "/v1/infer", "file-x", "24h", None, now)
    runner = LineRunner(services)
    records = Requests.from_settings(settings, services.client)  # the records the killed process left

    def line(n: int) -> Line:
        return Line(job.id, n, f"line-{n}", line_request_id(job.id, n), json.dumps({"input": f"text {n}"}), 0)

    def killed_sending(n: int, deadline_s: float, published: bool | None = None) -> str:
        """Line n as the killed process left it: claimed and being sent (or, ``published=False``, not yet) by a
        process with no lease; its item id."""
        idem = Idempotency.of(idempotency_key(job.id, f"line-{n}"), job.endpoint, {"input": f"text {n}"})
        at = services.clock()
        first = Record(request_id=line_request_id(job.id, n), tenant="alice", model="sim", items=(uuid.uuid4().hex,),
                       accepted_at=at, deadline=at + deadline_s, instance="killed", shape=Shape("infer", single=True),
                       published=published, key_hash=idem.key_hash)
        assert records.claim(first, idem, at).claimed
        return first.items[0]

    try:
        # it ran, and its result is in before the job is taken over: its answer, and no second run
        item = killed_sending(1, 30)
        run(device.writer, line(1).request_id, [(item, "text 1")], "nobody")
        first = runner(job, line(1))
        assert device.runs == Counter(), "the line was published again"
        assert (first.status_code, first.ran, first.body["output"]) == (200, False, "ran text 1"), first
        # it is still running when the job is taken over: waited for, then its answer
        item = killed_sending(2, 30)
        later = threading.Timer(1.0, run, (device.writer, line(2).request_id, [(item, "text 2")], "nobody"))
        later.start()
        second = runner(job, line(2))
        later.join()
        assert device.runs == Counter(), "the line was published again"
        assert (second.status_code, second.ran, second.body["output"]) == (200, False, "ran text 2"), second
        # it never ran and its deadline passes without a result: that run is over (504), and the line's next run,
        # under a key of its own, runs it once
        killed_sending(3, 1)
        third = runner(job, line(3))
        assert (third.status_code, third.error_type) == (504, "deadline_exceeded"), third
        assert device.runs == Counter()
        third = runner(job, line(3), generation=1)
        assert (third.status_code, third.ran, third.body["output"]) == (200, True, "ran text 3"), third
        assert device.runs == Counter({line(3).request_id: 1})
        # its process died before it was being sent: it never ran, so it runs at once, long before its deadline
        killed_sending(4, 600, published=False)
        started = time.monotonic()
        fourth = runner(job, line(4))
        assert (fourth.status_code, fourth.ran, fourth.body["output"]) == (200, True, "ran text 4"), fourth
        assert device.runs == Counter({line(3).request_id: 1, line(4).request_id: 1})
        assert time.monotonic() - started < 60, "a call never sent was followed to its deadline"
    finally:
        services.client.delete(*services.client.keys(f"{settings.broker.namespace}:*") or ["none"])


@pytest.mark.fault
def test_a_job_survives_its_api_batcher_and_worker_being_killed(jobs_stack: Stack, alice: openai.OpenAI) -> None:
    items_before = jobs_stack.items_done()
    batch = submit(alice, infer_lines([f"outlive {i}" for i in range(500)], model="slow"))
    wait_for(lambda: counts(alice.batches.retrieve(batch.id)).completed >= 100, 30, "a fifth done")
    jobs_stack.kill("web")  # the API that took the job: lines run in llmb-jobs, not in it
    jobs_stack.kill("batcher")
    jobs_stack.kill("gpu1")  # its supervisor and worker: a host lost mid-batch
    jobs_stack.start_batcher()
    jobs_stack.start_worker(1, model="slow", sim_batch_ms=1000)
    jobs_stack.start_web(workers=1, port=jobs_stack.port)  # back where its callers know it
    done = finished(alice, batch.id, timeout_s=90)
    assert done.status == "completed" and counts(done).completed == 500, done.request_counts
    outputs = read(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in outputs) == sorted(f"line-{i}" for i in range(500))
    assert all(x["response"]["body"]["output"] == expected(f"outlive {x['custom_id'].split('-')[1]}")
               for x in outputs)
    # no line ran twice: one ledger request per line, and no more device items than lines (a batch cut off on the
    # killed worker counts its items once more at most: they never finished there)
    wait_for(lambda: len(ledger_runs(jobs_stack, batch.id)) == 500, 20, "every line in the ledger")
    runs = ledger_runs(jobs_stack, batch.id)
    assert set(runs.values()) == {1}, {k: n for k, n in runs.items() if n > 1}
    assert jobs_stack.items_done() - items_before == 500


def test_a_tenant_at_its_cap_backs_off_and_its_job_still_completes(jobs_stack: Stack) -> None:
    jobs_stack.admin("tenants", "set", "capped", "--max-in-flight", "40")
    capped = client(jobs_stack, "capped")
    batch = submit(capped, infer_lines([f"capped {i}" for i in range(300)]))
    peak: list[int] = [0]

    def done() -> bool:
        peak[0] = max(peak[0], jobs_stack.tenant_inflight("capped"))
        return capped.batches.retrieve(batch.id).status == "completed"

    wait_for(done, 60, "the capped tenant's job")
    final = capped.batches.retrieve(batch.id)
    assert (counts(final).completed, counts(final).failed) == (300, 0), "429s are retried, not errors"
    assert len(read(capped, final.output_file_id)) == 300 and final.error_file_id is None
    assert peak[0] <= 40
    assert "429 tenant_over_limit" in jobs_stack.log("jobs") + jobs_stack.log("jobs2"), "it was refused, and backed off"


def test_db_upgrade_creates_the_batch_tables(database_url: str) -> None:
    import subprocess

    from harness.stack import BIN, ROOT

    def admin(*args: str) -> None:
        done = subprocess.run([str(BIN / "llmb-admin"), "--database-url", database_url, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    tables = {"files", "batch_jobs", "batch_lines"}
    admin("db", "upgrade")
    assert tables <= set(inspect(make_engine(database_url)).get_table_names())
    admin("db", "downgrade", "0002")
    assert not tables & set(inspect(make_engine(database_url)).get_table_names())
    admin("db", "upgrade")
    assert tables <= set(inspect(make_engine(database_url)).get_table_names())


@pytest.mark.fault
def test_a_job_survives_a_redis_restart_and_runs_no_finished_line_again(tmp_path: Path) -> None:
    """Redis (a private one, no persistence) SIGKILLed and started again mid-job: every record, claim and result it
    held is gone. The job completes with every line's own output; a line already finished in the database before
    the restart is not sent again (lines that were in flight may be: their first run's answer was lost)."""
    from harness.services import PrivateRedis

    private = PrivateRedis().start()
    try:
        with running_stack(tmp_path, workers=[(1, {"model": "slow", "sim_batch_ms": 500})], web_workers=1,
                           jobs=("jobs",), redis_url=private.url, auth="keys", auth_cache_s=0.5,
                           heartbeat_interval_s=0.25, files_dir=tmp_path / "files", jobs_poll_s=0.2, jobs_lease_s=2,
                           jobs_line_timeout_ms=30_000, offline_max_wait_ms=100) as s:
            bob = client(s, "bob")
            batch = submit(bob, infer_lines([f"restart {i}" for i in range(300)], model="slow"))
            wait_for(lambda: counts(bob.batches.retrieve(batch.id)).completed >= 100, 60, "a third done")
            # finished: the job committed their output rows. A line the ledger has as run but whose result was still
            # in Redis is in flight (seen: 16 such lines of a 100-line batch that had just ended ran again)
            done_before = finished_lines(s, batch.id)
            assert len(done_before) >= 100
            private.kill()
            private.start()
            done = finished(bob, batch.id, timeout_s=120)
            assert done.status == "completed" and counts(done).completed == 300, \
                (done.request_counts, read(bob, done.error_file_id)[:3] if done.error_file_id else None)
            outputs = read(bob, done.output_file_id)
            assert sorted(x["custom_id"] for x in outputs) == sorted(f"line-{i}" for i in range(300))
            assert all(x["response"]["body"]["output"] == expected(f"restart {x['custom_id'].split('-')[1]}")
                       for x in outputs)
            wait_for(lambda: len(ledger_runs(s, batch.id)) == 300, 30, "every line in the ledger")
            runs = ledger_runs(s, batch.id)
            twice = {k for k, n in runs.items() if n > 1}
            print(f"\nRedis restart mid-job: {len(done_before)} lines finished at the kill, {len(twice)} ran twice")
            assert not twice & done_before, \
                f"lines already run before the restart ran again: {sorted(twice & done_before)}"
    finally:
        private.stop()


def test_a_line_the_interactive_route_refuses_is_that_lines_400_at_once(jobs_stack: Stack,
                                                                        alice: openai.OpenAI) -> None:
    """A lone surrogate in a line's input (a 400 on /v1/infer) is that line's 400 in the error file, given at its
    first run: not an exception of the pipeline retried 8 times and written as a 500."""
    raw = (jsonl(infer_lines(["fine 0", "fine 1"]))
           + b'{"custom_id": "lone", "method": "POST", "url": "/v1/infer", "body": {"input": "x\\ud800y"}}\n')
    f = alice.files.create(file=("surrogate.jsonl", raw), purpose="batch")
    batch = create(alice, f.id, output_expires_after={"anchor": "created_at", "seconds": 7200})
    done = finished(alice, batch.id, timeout_s=30)
    assert done.status == "completed" and (counts(done).completed, counts(done).failed) == (2, 1)
    assert done.error_file_id is not None
    errors_file = alice.files.retrieve(done.error_file_id)
    assert errors_file.expires_at == errors_file.created_at + 7200, "output_expires_after, as OpenAI has it"
    [lone] = read(alice, done.error_file_id)
    assert lone["custom_id"] == "lone" and lone["response"]["status_code"] == 400, lone
    assert "surrogate" in lone["response"]["body"]["error"]["message"]
    shown = json.loads(jobs_stack.admin("jobs", "show", batch.id, "--lines", "5", "--json").stdout)
    assert {row["custom_id"]: row["status"] for row in shown["lines"]}["lone"] == "error"


def test_a_failed_jobs_errors_stay_small_in_every_listing(jobs_stack: Stack) -> None:
    """150 lines with a 20 KB url, and a 2 MB line (over the interactive 1 MiB body limit): the job fails with
    the first 100 errors and a count of the rest, each a short message, so the tenant's listing of 100 batches
    stays small (it was 20 KB per error, 2 MB per job)."""
    c = client(jobs_stack, "many-errors")
    lines = [{"custom_id": f"u{i}", "method": "POST", "url": "/v1/" + "u" * 20_000, "body": {"input": "x"}}
             for i in range(150)]
    lines.insert(0, {"custom_id": "huge", "method": "POST", "url": "/v1/infer", "body": {"input": "h" * 2_000_000}})
    batch = create(c, c.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch").id)
    done = finished(c, batch.id)
    assert done.status == "failed" and done.errors is not None
    codes = [e.code for e in batch_errors(done)]
    assert len(codes) == 101 and codes[0] == "line_too_large" and codes[-1] == "more_errors"
    first, last = batch_errors(done)[0].message, batch_errors(done)[-1].message
    assert first and "LLMB_MAX_BODY_BYTES" in first and last and "51 more" in last
    for _ in range(5):
        create(c, done.input_file_id)
    wait_for(lambda: all(b.status == "failed" for b in c.batches.list(limit=100)), 60, "every batch failed")
    listing = requests.get(jobs_stack.url + "/v1/batches?limit=100", headers={"Authorization": f"Bearer {c.api_key}"},
                           timeout=30)
    assert listing.status_code == 200 and len(listing.json()["data"]) == 6
    print(f"\nGET /v1/batches?limit=100: {len(listing.content)} bytes for 6 failed batches")
    assert len(listing.content) < 6 * 40_000, f"{len(listing.content)} bytes for 6 failed batches"


def test_jobs_show_escapes_what_a_tenant_wrote(jobs_stack: Stack, alice: openai.OpenAI) -> None:
    """`llmb-admin jobs show --lines` prints custom_ids with their control characters and terminal escapes
    escaped: a tenant cannot clear an operator's screen or forge lines of the listing."""
    evil = "\x1b[2J\x1b[31mred\r\nline 999  ok  forged"
    batch = submit(alice, [{"custom_id": evil, "method": "POST", "url": "/v1/infer", "body": {"input": "e"}}])
    finished(alice, batch.id)
    out = jobs_stack.admin("jobs", "show", batch.id, "--lines", "5").stdout
    assert "\x1b" not in out and "\r" not in out, repr(out)
    assert "\\x1b[2J\\x1b[31mred\\x0d\\x0aline 999" in out
    assert len([x for x in out.splitlines() if x.lstrip().startswith("line ")]) == 1, out
