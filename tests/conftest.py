"""Fixtures for end-to-end tests against the real RabbitMQ and Redis (started by .ci/run / bin/test).

A missing service is an error, never a skip: a green run must mean the pipeline really worked.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """gunicorn (2 processes), the batcher and two sim workers on two queues."""
    s = Stack(Path(tmp_path_factory.mktemp("stack")), redis_pool_size=10)
    try:
        s.start_worker(0)
        s.start_worker(1)
        s.start_batcher()
        s.start_web()
        s.wait_ready(workers=2)
        yield s
    finally:
        s.close()
