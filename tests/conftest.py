"""Fixtures for end-to-end tests against the real RabbitMQ and Redis (started by .ci/run / bin/test).

A missing service is an error, never a skip: a green run must mean the pipeline really worked.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from harness.stack import Stack, running_stack
from tasks.store.directory import TenantDirectory
from tasks.store.models import ApiKeyRecord, Base, TenantRecord, make_engine
from tasks.store.tenants import KeyStore

# fixtures of private services: private_redis, own_vhost, private_rabbit, rabbit
pytest_plugins = ["harness.services"]

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
    with postgres_database("llmb_test") as url:
        yield url


@contextlib.contextmanager
def postgres_database(prefix: str) -> Iterator[str]:
    """A new, empty PostgreSQL database of the caller's own on the test server (its SQLAlchemy URL), dropped
    afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def tenants(tmp_path: Path) -> tuple[KeyStore, TenantDirectory]:
    """A key store in a SQLite file and the in-memory key index over it, as an API process holds them."""
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    store = KeyStore(make_engine(url))
    return store, TenantDirectory(store, ttl_s=60.0)
