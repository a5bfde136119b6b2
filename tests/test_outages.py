"""Redis going away and coming back, on a Redis server of this test's own (the shared one stays up)."""
from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from harness.helpers import assert_json_error, expected, post
from harness.services import PrivateRedis
from harness.stack import Stack, running_stack, wait_for


@pytest.fixture
def outage_stack(tmp_path: Path) -> Iterator[tuple[Stack, PrivateRedis]]:
    private = PrivateRedis().start()
    try:
        with running_stack(tmp_path, web_workers=1, redis_url=f"redis://127.0.0.1:{private.port}/0",
                           heartbeat_interval_s=0.25) as stack:
            yield stack, private
    finally:
        private.stop()


def test_redis_down_means_fast_503s_and_service_resumes_when_it_is_back(
        outage_stack: tuple[Stack, PrivateRedis]) -> None:
    stack, private = outage_stack
    assert post(stack.url, {"input": "before"}).json()["output"] == expected("before")
    private.stop()
    started = time.monotonic()
    assert_json_error(post(stack.url, {"input": "during", "timeout_ms": 20_000}), 503, "unavailable")
    assert time.monotonic() - started < 5, "no hang while Redis is away"
    assert_json_error(requests.get(stack.url + "/readyz", timeout=10), 503)
    private.start()  # an empty Redis: workers re-announce themselves with their next heartbeats
    wait_for(lambda: requests.get(stack.url + "/readyz", timeout=5).status_code == 200, 30, "readiness again")
    r = post(stack.url, {"input": "after", "timeout_ms": 20_000})
    assert r.status_code == 200, r.text
    assert r.json()["output"] == expected("after")


def test_a_request_in_flight_while_redis_restarts_still_gets_its_own_output(
        outage_stack: tuple[Stack, PrivateRedis]) -> None:
    """The worker holds the batch's results until Redis is back (its task is not acknowledged before), and the
    waiting caller rides out the outage instead of failing."""
    stack, private = outage_stack
    stack.kill("gpu0", signal.SIGTERM)
    stack.start_worker(0, sim_batch_ms=1500)
    stack.wait_ready(workers=1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(post, stack.url, {"input": "across the outage", "timeout_ms": 20_000})
        wait_for(lambda: any(b'"busy"' in v for v in stack.redis.hvals(f"{stack.namespace}:fleet")), 20,
                 "the worker to start the batch")
        private.kill()
        wait_for(lambda: "Redis unreachable" in stack.log("gpu0"), 20, "the worker to hold its results for Redis")
        private.start()
        r = future.result(timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["output"] == expected("across the outage")
