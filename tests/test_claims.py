"""Batch claims against the real Redis: each lost batch is recovered exactly once."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tasks.claims import DONE, Claims
from tests.stack import REDIS_URL


@pytest.fixture
def claims() -> Iterator[Claims]:
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"test-claims-{uuid.uuid4().hex}"
    yield Claims(client, prefix, ttl_s=60)
    for key in client.scan_iter(prefix + ":*"):
        client.delete(key)


def test_a_batch_runs_once(claims: Claims) -> None:
    assert claims.for_run("b1", "gpu0@h") == "run"
    assert claims.for_run("b1", "gpu1@h") == "died"  # a redelivery: its first runner never finished it
    assert claims.for_run("b1", "gpu1@h") == "skip"


def test_a_finished_batch_is_never_recovered(claims: Claims) -> None:
    claims.for_run("b1", "gpu0@h")
    claims.client.set(claims.key("b1"), DONE)
    assert claims.for_recovery("b1", "t1") == "skip"
    assert claims.for_run("b1", "gpu0@h") == "skip"


def test_recovering_a_batch_that_never_started_blocks_its_lost_worker(claims: Claims) -> None:
    assert claims.for_recovery("b1", "t1") == "stranded"
    assert claims.for_recovery("b1", "t1") == "stranded"  # the same recovery message, redelivered
    assert claims.for_recovery("b1", "t2") == "skip"  # anyone else
    assert claims.for_run("b1", "gpu0@h") == "skip"  # the frozen worker wakes up: it must not run it


def test_recovering_a_batch_that_was_running_splits_it_once(claims: Claims) -> None:
    claims.for_run("b1", "gpu0@h")
    assert claims.for_recovery("b1", "t1") == "died"
    assert claims.for_recovery("b1", "t1") == "died"
    assert claims.for_recovery("b1", "t2") == "skip"
    assert claims.for_run("b1", "gpu1@h") == "skip"


def test_a_failed_hand_back_can_be_retried(claims: Claims) -> None:
    claims.for_run("b1", "gpu0@h")
    assert claims.for_run("b1", "gpu0@h") == "died"
    claims.restore("b1", "gpu0@h")  # publishing the hand-back failed
    assert claims.for_run("b1", "gpu0@h") == "died"
