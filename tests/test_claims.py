"""Batch claims against the real Redis: each lost batch is recovered exactly once."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from harness.stack import REDIS_URL
from tasks.state.claims import DONE, Claims

RUN0, RUN0_AGAIN, RUN1 = "gpu0@h/a1", "gpu0@h/b2", "gpu1@h/c3"  # RUN0_AGAIN: gpu0 restarted by its supervisor


@pytest.fixture
def claims() -> Iterator[Claims]:
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"test-claims-{uuid.uuid4().hex}"
    yield Claims(client, prefix, ttl_s=60)
    for key in client.scan_iter(prefix + ":*"):
        client.delete(key)


def test_a_batch_runs_once(claims: Claims) -> None:
    assert claims.for_run("b1", RUN0).verdict == "run"
    died = claims.for_run("b1", RUN1)  # a redelivery: its first runner never finished it
    assert died.verdict == "died" and died.owner == RUN0 and died.worker == "gpu0@h"
    assert claims.for_run("b1", RUN1).verdict == "skip"


def test_a_restarted_worker_that_gets_its_own_batch_back_reports_the_death(claims: Claims) -> None:
    claims.for_run("b1", RUN0)
    died = claims.for_run("b1", RUN0_AGAIN)
    assert died.verdict == "died" and died.worker == "gpu0@h"


def test_the_same_run_getting_its_batch_again_is_not_a_death(claims: Claims) -> None:
    claims.for_run("b1", RUN0)
    assert claims.for_run("b1", RUN0).verdict == "mine"  # e.g. redelivered after a broker connection loss
    assert claims.for_recovery("b1", "t1").verdict == "died"  # but if the run is then lost, it is a death


def test_a_finished_batch_is_never_recovered(claims: Claims) -> None:
    claims.for_run("b1", RUN0)
    claims.client.set(claims.key("b1"), DONE)
    assert claims.for_recovery("b1", "t1").verdict == "skip"
    assert claims.for_run("b1", RUN0).verdict == "skip"


def test_recovering_a_batch_that_never_started_blocks_its_lost_worker(claims: Claims) -> None:
    assert claims.for_recovery("b1", "t1").verdict == "stranded"
    assert claims.for_recovery("b1", "t1").verdict == "stranded"  # the same recovery message, redelivered
    assert claims.for_recovery("b1", "t2").verdict == "skip"  # anyone else
    assert claims.for_run("b1", RUN0).verdict == "skip"  # the frozen worker wakes up: it must not run it


def test_recovering_a_batch_that_was_running_splits_it_once(claims: Claims) -> None:
    claims.for_run("b1", RUN0)
    first = claims.for_recovery("b1", "t1")
    assert first.verdict == "died" and first.worker == "gpu0@h"
    again = claims.for_recovery("b1", "t1")  # the same recovery message, redelivered: the same verdict
    assert again.verdict == "died" and again.owner == RUN0
    assert claims.for_recovery("b1", "t2").verdict == "skip"
    assert claims.for_run("b1", RUN1).verdict == "skip"


def test_a_failed_hand_back_can_be_retried(claims: Claims) -> None:
    claims.for_run("b1", RUN0)
    assert claims.for_run("b1", RUN1).verdict == "died"
    claims.restore("b1", RUN0)  # publishing the hand-back failed
    assert claims.for_run("b1", RUN1).verdict == "died"
