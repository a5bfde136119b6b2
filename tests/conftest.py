"""Fixtures for end-to-end tests against the real RabbitMQ and Redis (started by .ci/run / bin/test).

A missing service is an error, never a skip: a green run must mean the pipeline really worked.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.harness.stack import Stack, running_stack

# fixtures of private services: private_redis, own_vhost, private_rabbit, rabbit
pytest_plugins = ["tests.harness.services"]

PG_ADMIN = os.environ.get("LLMB_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """gunicorn (2 processes), the batcher and two sim workers on two queues."""
    with running_stack(Path(tmp_path_factory.mktemp("stack")), workers=(0, 1), redis_pool_size=10) as s:
        yield s


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind the ledger supports: a SQLite file, and a PostgreSQL database of its own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    name = f"llmb_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
