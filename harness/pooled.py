"""Callers as real clients are: one aiohttp ``ClientSession`` (a connection pool) shared by many callers.

A web backend in front of the service keeps one session for all its users, so one tenant's flood and another's
steady calls share a pool of kept-alive connections, and a server that closes a connection on which a request
has started (or drops one under load) shows up as a connection error here, where a client opening a
connection per call (``harness/loadgen.py``, ``bench/load.py``) would not see it. Retries are off: every error
counts.

    calls = asyncio.run(burst(url, 3000, tenant="a", timeout_ms=5000))
    print(summary(calls))
"""
from __future__ import annotations

import asyncio
import collections
import json
import re
import time
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from harness.helpers import expected
from harness.stack import Stack, WorkerSpec, running_stack
from harness.stats import percentile

CLIENT_SLACK_S = 5.0  # the client gives up this long after the call's deadline (a hang is counted, not waited on)


@dataclass
class Call:
    """One call as its caller saw it: status 0 when no HTTP answer came (``error`` says why)."""
    tenant: str
    sent_at: float
    status: int
    latency_s: float
    error: str = ""  # the client's exception, when no answer came
    json_error: bool = True  # an error answer in the JSON shape
    own_output: bool = True  # a 200's output is this call's own input's
    error_type: str = ""  # error.type of a JSON error answer
    message: str = ""
    wait_s: float = 0.0  # from when the request's headers were written (the client's own delay before excluded)


def keyed_stack(tmp: Path, batchers: int = 1, embed: bool = False,
                **env: object) -> AbstractContextManager[Stack]:
    """The system as these scenarios run it: API keys on, one sim worker at 250 ms per batch (400/s), two API
    processes, ``batchers`` batchers, and (``embed``) an all-MiniLM-L6-v2 worker for /v1/embeddings."""
    workers: list[WorkerSpec] = [0, (1, {"backend": "hf-embed"})] if embed else [0]
    return running_stack(tmp, workers=workers, batchers=batchers, settings={"auth": "keys", "sim_batch_ms": 250, **env})


def key(stack: Stack, tenant: str) -> str:
    """A new API key for ``tenant``, issued as an operator does."""
    return stack.admin("keys", "create", tenant).stdout.strip()


async def _headers_sent(_: Any, context: Any, __: Any) -> None:
    if isinstance(context.trace_request_ctx, dict):
        context.trace_request_ctx["sent"] = time.monotonic()


def session(limit: int = 0, per_call: bool = False) -> aiohttp.ClientSession:
    """A pooled session as a web backend has it (``limit=0``: no cap on connections; aiohttp's default is 100),
    or (``per_call``) one that opens a new connection for each call and closes it after, as a client without a
    pool does. It notes when each request's headers were written: a client opening thousands of calls at once on
    two cores spends seconds of its own CPU before the last is sent, which is no part of the server's answer
    time."""
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_headers_sent)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=per_call),
                                 timeout=aiohttp.ClientTimeout(total=None), trace_configs=[trace])


async def warm(http: aiohttp.ClientSession, url: str, n: int) -> None:
    """Leave ``n`` open connections in ``http``'s pool (``n`` GET /healthz at once, each read whole), as a web
    backend's pool is after a busy moment: its next burst then goes out on them without connecting first."""
    async def one() -> None:
        async with http.get(f"{url}/healthz") as response:
            await response.read()

    await asyncio.gather(*(one() for _ in range(n)))


def headers_for(tenant: str, key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {"X-Tenant": tenant}


async def call(http: aiohttp.ClientSession, url: str, tenant: str, *, key: str | None = None,
               timeout_ms: int = 10_000) -> Call:
    """POST one /v1/infer call on the pool and wait for its answer (or the client's own time-out)."""
    text = f"{tenant}-{uuid.uuid4().hex}"
    traced: dict[str, float] = {}
    sent = time.monotonic()
    try:
        async with http.post(f"{url}/v1/infer", json={"input": text, "timeout_ms": timeout_ms},
                             headers=headers_for(tenant, key), trace_request_ctx=traced,
                             timeout=aiohttp.ClientTimeout(total=timeout_ms / 1000 + CLIENT_SLACK_S)) as response:
            raw = await response.read()
            status = response.status
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return Call(tenant, sent, 0, time.monotonic() - sent, error=f"{type(exc).__name__}: {exc}"[:200])
    now = time.monotonic()
    done = Call(tenant, sent, status, now - sent, wait_s=now - traced.get("sent", sent))
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = None
    if status == 200:
        done.own_output = isinstance(body, dict) and body.get("output") == expected(text)
    else:
        done.json_error = isinstance(body, dict) and isinstance(body.get("error"), dict)
        if done.json_error:
            done.error_type = str(body["error"].get("type") or body["error"].get("code"))
            done.message = str(body["error"].get("message"))[:200]
    return done


async def burst(url: str, n: int, tenant: str, *, key: str | None = None, timeout_ms: int = 5000,
                http: aiohttp.ClientSession | None = None) -> list[Call]:
    """``n`` calls sent at once on one pool."""
    own = http is None
    http = http or session()
    try:
        return list(await asyncio.gather(*(call(http, url, tenant, key=key, timeout_ms=timeout_ms)
                                           for _ in range(n))))
    finally:
        if own:
            await http.close()


async def steady(http: aiohttp.ClientSession, url: str, tenant: str, rate_per_s: float, duration_s: float, *,
                 key: str | None = None, timeout_ms: int = 10_000) -> list[Call]:
    """Calls evenly spaced at ``rate_per_s`` for ``duration_s`` (open loop), on the shared pool."""
    start, tasks = time.monotonic(), []
    for i in range(int(rate_per_s * duration_s)):
        delay = start + i / rate_per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(call(http, url, tenant, key=key, timeout_ms=timeout_ms)))
    return list(await asyncio.gather(*tasks))


def quantile_s(values: list[float], q: float) -> float:
    """The q-th percentile of ``values`` (harness/stats.py's, the one of every report), to the ms; 0 when none."""
    return round(percentile(values, q) or 0.0, 3)


def connection_errors(calls: list[Call]) -> list[Call]:
    return [c for c in calls if c.status == 0]


def summary(calls: list[Call]) -> dict[str, Any]:
    """Statuses, connection errors by kind, and latency quantiles (all calls, and the 200s and 429s apart)."""
    ok = [c.latency_s for c in calls if c.status == 200]
    refused = [c.latency_s for c in calls if c.status == 429]
    return {
        "calls": len(calls),
        "statuses": dict(sorted(collections.Counter(c.status for c in calls).items())),
        "connection_errors": len(connection_errors(calls)),
        "error_kinds": dict(collections.Counter(c.error.split(":")[0] for c in connection_errors(calls))),
        "error_examples": sorted({c.error for c in connection_errors(calls)})[:3],
        "error_types": dict(collections.Counter(c.error_type for c in calls if c.error_type)),
        "messages": sorted({c.message for c in calls if c.message})[:4],
        "not_json": sum(1 for c in calls if c.status not in (0, 200) and not c.json_error),
        "wrong_output": sum(1 for c in calls if c.status == 200 and not c.own_output),
        "p50_s": quantile_s(ok, 50), "p99_s": quantile_s(ok, 99), "p99_429_s": quantile_s(refused, 99),
        "p99_429_after_send_s": quantile_s([c.wait_s for c in calls if c.status == 429], 99),
        "p99_after_send_s": quantile_s([c.wait_s for c in calls if c.status == 200], 99),
        "refusals": refusals(calls),
    }


def refusals(calls: list[Call]) -> dict[str, dict[str, float]]:
    """The 429s by what refused them (the message with its figures taken out): how many, and their p50/p99 after
    sending. A refusal at arrival and one at the call's turn read alike to the caller but not here."""
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for c in calls:
        if c.status == 429:
            kinds[re.sub(r"\d+", "N", c.message)[:70]].append(c.wait_s)
    return {kind: {"count": len(waits), "p50_after_send_s": quantile_s(waits, 50),
                   "p99_after_send_s": quantile_s(waits, 99)} for kind, waits in sorted(kinds.items())}
