"""Small client helpers shared by end-to-end tests."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests


def expected(text: str) -> str:
    """The sim model's output, computed independently of the worker's code."""
    return "sim:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def decoded(reply: bytes | str) -> str:
    """A Redis reply as text: the tests' clients answer bytes, which redis-py types as ``bytes | str``."""
    return reply.decode() if isinstance(reply, bytes) else reply


def scored(reply: Sequence[Any]) -> list[tuple[str, float]]:
    """A ``ZRANGE ... WITHSCORES`` reply as (member, score) pairs (redis-py types it without knowing the scores
    were asked for)."""
    return [(decoded(member), float(score)) for member, score in reply]


def post(url: str, body: Any = None, *, data: bytes | str | None = None, headers: dict[str, str] | None = None,
         timeout: float = 60) -> requests.Response:
    if data is not None:
        return requests.post(url + "/v1/infer", data=data, headers=headers, timeout=timeout)
    return requests.post(url + "/v1/infer", json=body, headers=headers, timeout=timeout)


def post_many(url: str, bodies: list[Any], timeout: float = 60) -> list[requests.Response]:
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(lambda b: post(url, b, timeout=timeout), bodies))


def assert_json_error(response: requests.Response, status: int, type_: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"type", "message", "request_id"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["request_id"] == response.headers["X-Request-Id"]
    if type_:
        assert error["type"] == type_
    return error
