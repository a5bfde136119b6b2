"""A hostile tenant's batch jobs through real gunicorn and `llmb-jobs` (loopback, bounded in count and time): its
create-and-cancel loop over one file leaves the database's lines and size flat, and at its bound of batches not
yet ended one more is a 403 naming the bound, while another tenant's batch is taken and completes."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from harness.hostile import Tenant
from harness.stack import Stack, running_stack, wait_for
from tasks.store.models import BatchLineRecord, make_engine

MAX_ACTIVE = 3
ROUNDS = 6
LINES = 1000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("hostile_jobs"))
    with running_stack(tmp, workers=[0, (1, {"model": "slow", "sim_batch_ms": 300})], web_workers=1,
                       jobs=("jobs",), auth="keys", auth_cache_s=0.5, files_dir=tmp / "files", jobs_poll_s=0.2,
                       jobs_lease_s=2, jobs_line_timeout_ms=30_000, offline_max_wait_ms=100,
                       jobs_tenant_max_active=MAX_ACTIVE, jobs_initial_in_flight=4, jobs_max_in_flight=8) as s:
        yield s


def tenant(stack: Stack, name: str) -> Tenant:
    return Tenant(stack.url, stack.admin("keys", "create", name).stdout.strip())


def lines_in_database(stack: Stack) -> int:
    with Session(make_engine(stack.database_url)) as s:
        return int(s.scalar(select(func.count()).select_from(BatchLineRecord)) or 0)


def database_bytes(stack: Stack) -> int:
    path = Path(stack.database_url.removeprefix("sqlite:///"))
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if os.path.isfile(p))


def test_create_and_cancel_of_one_file_leaves_the_database_flat(stack: Stack) -> None:
    hostile = tenant(stack, "hostile")
    file_id = hostile.upload(LINES, model="slow")
    sizes, held = [], []
    for _ in range(ROUNDS):
        r = hostile.create(file_id)
        assert r.status_code == 200, r.text
        batch_id = r.json()["id"]
        wait_for(lambda: hostile.status(batch_id) == "in_progress", 30, "its lines written")  # noqa: B023
        hostile.cancel(batch_id)
        wait_for(lambda: hostile.status(batch_id) == "cancelled", 30, "cancelled")  # noqa: B023
        held.append(lines_in_database(stack))
        sizes.append(database_bytes(stack))
    print(f"\nthe SQLite store after each of {ROUNDS} create-and-cancel rounds of a {LINES}-line file: {sizes}")
    assert held == [0] * ROUNDS, "a cancelled batch's lines go with it"
    # the first rounds fill the WAL and reused pages; then only the ledger's rows of the lines that ran grow it,
    # not a round's lines (what each round added before: 1.7 MB a round)
    assert sizes[-1] - sizes[ROUNDS // 2] < (sizes[1] - sizes[0]) / 2, sizes


def test_a_tenant_at_its_bound_of_batches_is_refused_and_another_is_served(stack: Stack) -> None:
    hostile, steady = tenant(stack, "flooder"), tenant(stack, "steady")
    file_id = hostile.upload(200, model="slow")
    taken = [hostile.create(file_id) for _ in range(MAX_ACTIVE)]
    assert [r.status_code for r in taken] == [200] * MAX_ACTIVE
    refused = hostile.create(file_id)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "quota_exceeded" and "LLMB_JOBS_TENANT_MAX_ACTIVE" in error["message"]
    assert f"its bound is {MAX_ACTIVE}" in error["message"]
    mine = steady.create(steady.upload(5))
    assert mine.status_code == 200, mine.text
    wait_for(lambda: steady.status(mine.json()["id"]) == "completed", 60, "the steady tenant's batch")
    for r in taken:
        hostile.cancel(r.json()["id"])
    wait_for(lambda: all(hostile.status(r.json()["id"]) == "cancelled" for r in taken), 60, "cancelled")
    assert hostile.create(file_id).status_code == 200, "ended batches free their places"
