"""Hosts whose clocks disagree: every process reads time on Redis's clock (tasks.state.clock), so deadlines
and heartbeats mean the same on every host.

The end-to-end test runs the GPU worker 30 s behind and the batcher 30 s ahead (``LLMB_CLOCK_SKEW_S``, a
setting for tests only). Read on their own clocks, the worker's heartbeats would look 30 s stale (no live
worker: 503) and the batcher would find every request's deadline long past (504 for all).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from harness.helpers import assert_json_error, expected, post, post_many
from harness.stack import REDIS_URL, Stack, free_port, running_stack, wait_for
from tasks.state.clock import SharedClock


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_a_skewed_host_reads_redis_time() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    for skew in (-3600.0, -30.0, 0.0, 45.5):
        clock = SharedClock(client, skew_s=skew)
        assert abs(clock() - redis_now(client)) < 0.05, f"skew {skew}"
        assert clock.synced and abs(clock.offset + skew) < 0.05


def test_while_redis_is_away_the_last_offset_holds_and_it_is_measured_again_later() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    ticks = [0.0]
    clock = SharedClock(client, skew_s=-100.0, resync_s=60.0, monotonic=lambda: ticks[0])
    clock()
    assert abs(clock.offset - 100.0) < 0.05
    clock.client = redis.Redis(port=free_port(), socket_connect_timeout=0.5)  # nothing listens there
    ticks[0] = 61.0  # a re-measurement is due, and fails
    assert abs(clock() - redis_now(client)) < 0.05
    assert not clock.sync()
    clock.client = client
    ticks[0] = 120.0
    assert abs(clock() - redis_now(client)) < 0.05 and clock.synced


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("skewed")), workers=(), batchers=0, web_workers=None,
                       ready=False) as s:
        s.start_worker(0, clock_skew_s=-30)
        s.start_batcher(clock_skew_s=30)
        s.start_web(workers=1, clock_skew_s=7)
        s.wait_ready(workers=1)
        yield s


def test_with_every_host_on_its_own_clock_requests_are_served_and_deadlines_hold(skewed: Stack) -> None:
    texts = [f"skewed clocks {i}" for i in range(30)]
    answers = post_many(skewed.url, [{"input": t, "timeout_ms": 10_000} for t in texts])
    assert [r.status_code for r in answers] == [200] * len(texts)
    assert [r.json()["output"] for r in answers] == [expected(t) for t in texts]

    # a deadline shorter than one batch (250 ms) still ends in 504, on time, and nothing stays admitted
    started = time.monotonic()
    late = post(skewed.url, {"input": "too short", "timeout_ms": 100})
    assert_json_error(late, 504, "deadline_exceeded")
    assert time.monotonic() - started < 1.1
    wait_for(lambda: skewed.inflight() == 0, 10, "admission to be released")

    fleet = {w["id"]: w for w in json.loads(skewed.admin("workers", "--json").stdout)}
    assert fleet["gpu0@test"]["live"] is True, fleet
    assert abs(fleet["gpu0@test"]["heartbeat_at"] - redis_now(skewed.redis)) < 2, "heartbeats are on Redis time"
