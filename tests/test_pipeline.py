"""End to end through real processes: gunicorn -> RabbitMQ -> batcher -> sim GPU workers -> Redis -> caller.

Timing bounds here are deliberately generous: speed is measured by the benchmark, not asserted by tests.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests

from harness.helpers import assert_json_error, expected, post, post_many
from harness.stack import BIN, REDIS_URL, Stack, running_stack, wait_for

BATCH_S = 0.250  # the sim backend's default batch time
MAX_WAIT_S = 0.020


def test_300_concurrent_requests_each_get_their_own_output(stack: Stack) -> None:
    tag = uuid.uuid4().hex[:6]
    texts = [f"{tag} request {i}" for i in range(300)]
    client = redis.Redis.from_url(REDIS_URL)
    baseline = len(client.client_list())
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:  # a measurement, not a wait: Redis's connection count, every 20 ms while the calls run
        while not done.wait(0.02):
            peak[0] = max(peak[0], len(client.client_list()))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        responses = post_many(stack.url, [{"input": t} for t in texts])
    finally:
        done.set()
        sampler.join()
    for text, r in zip(texts, responses):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["output"] == expected(text)
        assert body["id"] == r.headers["X-Request-Id"]
        assert 1 <= body["batch"]["size"] <= 100
        assert set(body["timing"]) == {"queued_ms", "run_ms", "total_ms"}
    # Waiters share one subscription and a bounded pool per API process (2 processes, pool of 10 each):
    # 300 waiting requests must not mean 300 Redis connections. (Each of the 2 workers may open a second
    # connection: its host thread writes a batch's results while the next batch is claimed.)
    assert peak[0] - baseline <= 2 * (10 + 1) + 2, (baseline, peak[0])


def test_a_call_with_several_inputs_gets_them_back_in_order(stack: Stack) -> None:
    texts = [f"multi {i}" for i in range(7)]
    r = post(stack.url, {"inputs": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["outputs"] == [expected(t) for t in texts]
    assert sum(1 for _ in body["batches"]) >= 1 and body["batch"] == body["batches"][0]


def test_a_lone_request_is_answered_within_wait_plus_batch_time(stack: Stack) -> None:
    wait_for(lambda: stack.redis.zcard(f"{stack.namespace}:inflight") == 0, 10, "an idle system")
    started = time.monotonic()
    r = post(stack.url, {"input": "all alone"}, headers={"X-Request-Id": "lone-caller-1"})
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == "lone-caller-1" and r.json()["id"] == "lone-caller-1"
    assert r.json()["batch"]["size"] == 1
    assert elapsed < MAX_WAIT_S + BATCH_S + 0.75, elapsed


def test_150_requests_at_once_are_served_in_batches_of_at_most_100(stack: Stack) -> None:
    texts = [f"burst {uuid.uuid4().hex}" for _ in range(150)]
    responses = post_many(stack.url, [{"input": t} for t in texts])
    sizes: dict[str, int] = {}
    for text, r in zip(texts, responses):
        assert r.status_code == 200, r.text
        assert r.json()["output"] == expected(text)
        sizes[r.json()["batch"]["id"]] = r.json()["batch"]["size"]
    assert max(sizes.values()) <= 100
    assert sum(sizes.values()) == 150  # every request is in exactly one reported batch
    assert len(sizes) < 150, "requests sent together must share batches"


@pytest.mark.fault
def test_inputs_too_big_to_share_one_broker_message_are_split_across_batches(stack: Stack) -> None:
    """60 inputs of 400,000 non-ASCII characters: 2.4 MB each once JSON-escaped, 144 MB as one batch, beyond
    RabbitMQ's 128 MiB message limit. Batches end at LLMB_MAX_BATCH_BYTES (16 MiB) instead."""
    texts = [f"{k} " + "\u00e9" * 400_000 for k in range(60)]
    bodies = [json.dumps({"input": t, "timeout_ms": 120_000}, ensure_ascii=False).encode() for t in texts]

    def send(body: bytes) -> requests.Response:
        return requests.post(stack.url + "/v1/infer", data=body, headers={"Content-Type": "application/json"},
                             timeout=180)

    with ThreadPoolExecutor(max_workers=60) as pool:
        responses = list(pool.map(send, bodies))
    sizes: dict[str, int] = {}
    for text, r in zip(texts, responses):
        assert r.status_code == 200, r.text[:300]
        assert r.json()["output"] == expected(text)
        sizes[r.json()["batch"]["id"]] = r.json()["batch"]["size"]
    assert sum(sizes.values()) == 60 and max(sizes.values()) <= 7  # 16 MiB / 2.4 MB


def test_over_the_admission_cap_callers_get_429_and_nothing_extra_is_enqueued(stack: Stack) -> None:
    capped = stack.start_web("web-capped", workers=1, admission_cap=10)
    wait_for(lambda: stack.redis.zcard(f"{stack.namespace}:inflight") == 0, 10, "an idle system")
    before = stack.items_done()
    responses = post_many(capped, [{"input": f"cap {i}", "timeout_ms": 20_000} for i in range(40)])
    statuses = [r.status_code for r in responses]
    ok = statuses.count(200)
    refused = [r for r in responses if r.status_code == 429]
    assert ok + len(refused) == 40, statuses
    assert ok >= 1 and refused, statuses
    for r in refused:
        assert_json_error(r, 429, "queue_full")
        assert int(r.headers["Retry-After"]) >= 1
    wait_for(lambda: stack.request_queue_depth() == 0, 10, "an empty request queue")
    # Let any (wrongly) enqueued extra work surface before counting: a request sent now queues behind it (one
    # request queue, one batcher taking its requests in order), so once it is answered everything ahead of it
    # has been dispatched; once both workers then report idle, that has run too.
    last = post(capped, {"input": "after the refusals", "timeout_ms": 20_000})
    assert last.status_code == 200 and last.json()["output"] == expected("after the refusals"), last.text
    stack.wait_idle(since=time.time())
    assert stack.items_done() - before == ok + 1  # the answered calls and the last one, nothing refused


def test_a_deadline_shorter_than_the_batch_gets_504_on_time(stack: Stack) -> None:
    started = time.monotonic()
    r = post(stack.url, {"input": "too slow for me", "timeout_ms": 100})
    elapsed = time.monotonic() - started
    assert_json_error(r, 504, "deadline_exceeded")
    assert elapsed < 0.100 + 0.5, elapsed
    # Its late result, if the model ran it at all, is discarded harmlessly: the next caller is fine.
    r = post(stack.url, {"input": "after the timeout"})
    assert r.status_code == 200 and r.json()["output"] == expected("after the timeout")


def test_malformed_and_oversized_bodies_do_not_disturb_healthy_requests(stack: Stack) -> None:
    texts = [f"healthy {i}" for i in range(60)]
    with ThreadPoolExecutor(max_workers=70) as pool:
        healthy = [pool.submit(post, stack.url, {"input": t}) for t in texts]
        bad = [
            (pool.submit(post, stack.url, data="{not json"), 400),
            (pool.submit(post, stack.url, data=b"\xff\xfe\x00garbage"), 400),
            (pool.submit(post, stack.url, {"input": 42}), 400),
            (pool.submit(post, stack.url, {"inputs": ["x"] * 101}), 400),
            (pool.submit(post, stack.url, {"input": "x", "timeout_ms": -5}), 400),
            (pool.submit(post, stack.url, {"input": "x" * (2 * 1024 * 1024)}), 413),
            (pool.submit(post, stack.url, data="[]"), 400),
        ]
        for future, status in bad:
            assert_json_error(future.result(), status)
        for text, future in zip(texts, healthy):
            r = future.result()
            assert r.status_code == 200 and r.json()["output"] == expected(text)
    assert_json_error(requests.get(stack.url + "/v1/infer", timeout=5), 405)
    assert_json_error(requests.get(stack.url + "/nope", timeout=5), 404)


def test_health_and_readiness(stack: Stack) -> None:
    assert requests.get(stack.url + "/healthz", timeout=5).json() == {"status": "ok"}
    ready = requests.get(stack.url + "/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json()["workers"] == 2


def test_503_when_no_worker_rabbitmq_or_redis_is_there(stack: Stack) -> None:
    # A web server of an empty namespace: broker and Redis fine, no worker alive.
    lonely = stack.start_web("web-lonely", workers=1, namespace=f"{stack.namespace}x")
    assert_json_error(requests.get(lonely + "/readyz", timeout=5), 503, "unavailable")
    assert_json_error(post(lonely, {"input": "anyone?"}), 503, "unavailable")
    # Same fleet, but RabbitMQ unreachable.
    no_broker = stack.start_web("web-nobroker", workers=1, broker_url="amqp://guest:guest@127.0.0.1:1//")
    started = time.monotonic()
    assert_json_error(post(no_broker, {"input": "hello"}), 503, "unavailable")
    assert time.monotonic() - started < 10
    assert_json_error(requests.get(no_broker + "/readyz", timeout=10), 503)
    # Redis unreachable.
    no_redis = stack.start_web("web-noredis", workers=1, redis_url="redis://127.0.0.1:1/0")
    assert_json_error(post(no_redis, {"input": "hello"}), 503, "unavailable")
    assert_json_error(requests.get(no_redis + "/readyz", timeout=10), 503)


def test_killing_the_batcher_with_requests_buffered_loses_none(stack: Stack) -> None:
    """SIGKILL a batcher holding requests unacknowledged in its buffer; after a restart all are answered."""
    stack.kill("batcher", sig=15)
    # a fixed 60 s wait: it holds everything it gets
    stack.start_batcher("slow-batcher", wait_mode="fixed", max_wait_ms=60_000, max_batch_size=100)
    wait_for(lambda: stack.request_queue_consumers() == 1, 30, "the slow batcher to consume the request queue")
    done_before = stack.items_done()
    keep = [f"survivor {i}" for i in range(10)]
    with ThreadPoolExecutor(max_workers=13) as pool:
        survivors = [pool.submit(post, stack.url, {"input": t, "timeout_ms": 60_000}) for t in keep]
        doomed = [pool.submit(post, stack.url, {"input": f"doomed {i}", "timeout_ms": 1500}) for i in range(3)]
        wait_for(lambda: stack.redis.zcard(f"{stack.namespace}:inflight") == 13, 10, "13 admitted items")
        wait_for(lambda: stack.request_queue_depth() == 0, 10, "the batcher to take every message")
        # Had the slow batcher sent them on (it must not), both workers would have run that batch by the time
        # their queues are seen empty and each then reports itself idle.
        stack.wait_idle(since=time.time())
        assert stack.items_done() == done_before, "the slow batcher must not have sent any of them to a worker"
        assert not any(f.done() for f in survivors), "the slow batcher must still be holding them"
        stack.kill("slow-batcher", sig=9)
        # unacknowledged messages went back to the queue (a message carries the calls of one round at the door)
        assert stack.request_queue_depth() >= 1
        for future in doomed:  # no batcher now: these callers' deadlines pass while it is down
            future.result()
        stack.start_batcher()
        for text, future in zip(keep, survivors):
            r = future.result()
            assert r.status_code == 200, r.text
            assert r.json()["output"] == expected(text)
        for future in doomed:
            assert_json_error(future.result(), 504, "deadline_exceeded")


def test_metrics_add_up_across_api_processes_and_cover_the_whole_system(stack: Stack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        text = requests.get(stack.url + "/metrics", timeout=10).text
        return {f"{s.name}{sorted(s.labels.items())}": s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    ok_key = "llmb_http_requests_total[('status', '200'), ('type', '')]"
    responses = post_many(stack.url, [{"input": f"metrics {i}"} for i in range(40)])
    assert all(r.status_code == 200 for r in responses)
    assert_json_error(post(stack.url, data="{broken"), 400)
    after = scrape()  # whichever gunicorn process answers, it reports both processes' requests
    assert after[ok_key] - before.get(ok_key, 0) == 40
    # counters are cumulative over the module's stack: what this test did is the difference
    bad_key = "llmb_http_requests_total[('status', '400'), ('type', 'invalid_request')]"
    assert after[bad_key] - before.get(bad_key, 0) == 1
    timed_key = "llmb_request_duration_seconds_count[('status', '200')]"
    assert after[timed_key] - before.get(timed_key, 0) == 40
    batches = after["llmb_batch_size_count[]"] - before.get("llmb_batch_size_count[]", 0)
    assert 1 <= batches <= 40
    assert after["llmb_batch_size_sum[]"] - before.get("llmb_batch_size_sum[]", 0) == 40
    assert after["llmb_batch_run_seconds_count[]"] - before.get("llmb_batch_run_seconds_count[]", 0) == batches
    assert after["llmb_workers[('state', 'idle')]"] + after["llmb_workers[('state', 'busy')]"] == 2
    for name in ("llmb_queue_depth[]", "llmb_in_flight_items[]", "llmb_oldest_waiting_seconds[]",
                 "llmb_quarantined_inputs[]", "llmb_poison_inputs_total[]", "llmb_ledger_records_dropped_total[]"):
        assert name in after, name


def test_flower_lists_the_running_gpu_workers(stack: Stack) -> None:
    flower = stack.start_flower()

    def workers() -> set[str]:
        return set(requests.get(flower + "/api/workers", auth=Stack.FLOWER_AUTH, timeout=10).json())

    wait_for(lambda: {"gpu0@test", "gpu1@test"} <= workers(), 60, "Flower to list both GPU workers")
    assert requests.get(flower + "/api/workers", timeout=10).status_code == 401, "no API without credentials"


def test_two_batchers_started_with_their_defaults_on_one_host_both_serve(tmp_path: Path) -> None:
    """No --hostname: each takes a node name of its own (two of one name would collide on Celery's control
    queue and the second would die at start)."""
    with running_stack(tmp_path, workers=(), batchers=0, web_workers=None, ready=False) as s:
        s.start_worker(0)
        for name in ("batcher-a", "batcher-b"):
            s._spawn(name, [str(BIN / "llmb-batcher")])
        url = s.start_web(workers=1)
        s.wait_ready(workers=1)
        wait_for(lambda: s.request_queue_consumers() == 2, 30, "both batchers consuming the request queue")
        texts = [f"two batchers {i}" for i in range(40)]
        answers = post_many(url, [{"input": t} for t in texts])
        assert [r.status_code for r in answers] == [200] * len(texts)
        assert [r.json()["output"] for r in answers] == [expected(t) for t in texts]
        assert all(s.procs[n].poll() is None for n in ("batcher-a", "batcher-b"))


@pytest.mark.fault
def test_on_quorum_queues_every_queue_is_quorum_and_a_killed_worker_loses_nothing(tmp_path: Path) -> None:
    """LLMB_QUEUE_TYPE=quorum: the request, recovery and GPU worker queues are quorum queues (replicated in a
    RabbitMQ cluster), and the pipeline keeps its guarantees on them: a worker SIGKILLed mid-batch has its
    batch redelivered and every caller gets its own answer."""
    with running_stack(tmp_path, workers=(0, 1), web_workers=1, queue_type="quorum") as s:
        url = s.url
        texts = [f"quorum {i}" for i in range(60)]
        answers = post_many(url, [{"input": t} for t in texts[:20]])
        assert [r.json().get("output") for r in answers] == [expected(t) for t in texts[:20]]

        listed = subprocess.run(["rabbitmqctl", "list_queues", "-q", "name", "type"], capture_output=True,
                                text=True, timeout=60, check=True).stdout
        types = dict(line.split()[:2] for line in listed.splitlines() if line.startswith(s.namespace + "."))
        for queue in (f"{s.namespace}.requests", f"{s.namespace}.recovery", f"{s.namespace}.gpu.test.0",
                      f"{s.namespace}.gpu.test.1"):
            assert types.get(queue) == "quorum", f"{queue} is {types.get(queue)!r}: {types}"

        with ThreadPoolExecutor(40) as pool:
            def paced(i_text: tuple[int, str]) -> requests.Response:  # a stream over 2 s: both workers get some
                time.sleep(i_text[0] * 0.05)
                return post(url, {"input": i_text[1], "timeout_ms": 20_000})

            later = pool.map(paced, enumerate(texts[20:]))
            s.wait_batch_start(0, within_s=0.2)
            os.kill(s.worker_child(0), signal.SIGKILL)
            answers = list(later)
        assert [r.status_code for r in answers] == [200] * 40
        assert [r.json()["output"] for r in answers] == [expected(t) for t in texts[20:]]


def test_a_stale_batch_whose_items_another_batch_answered_is_not_run_again(stack: Stack) -> None:
    """A batcher cut off from the broker sends, when its link comes back, a batch its standby re-formed and ran
    meanwhile: the worker drops the items that already have an answer instead of running them again."""
    from tasks.broker.celery_app import RUN_BATCH, make_celery
    from tasks.config import Settings
    from tasks.schema import Batch, BatchItem

    answer = post(stack.url, {"input": "answered once"})
    assert answer.status_code == 200
    item_id = next(key.decode().rsplit(":", 1)[1] for key in stack.redis.scan_iter(f"{stack.namespace}:result:*"))
    before = stack.redis.get(f"{stack.namespace}:result:{item_id}")
    now = time.time()
    stale = Batch(id=uuid.uuid4().hex, model="sim", created_at=now, items=(BatchItem(
        id=item_id, request_id="stale", input="answered once", deadline=now + 30, accepted_at=now,
        reply_to=f"{stack.namespace}:nobody"),))
    app = make_celery(Settings.from_env(stack.env))
    app.send_task(RUN_BATCH, args=[stale.to_dict()], queue=f"{stack.namespace}.gpu.test.0", task_id=stale.id)
    wait_for(lambda: f"batch {stale.id}: 1 item(s) already answered" in stack.log("gpu0"), 15,
             "the worker to drop the stale batch's answered item")
    assert stack.redis.get(f"{stack.namespace}:result:{item_id}") == before
