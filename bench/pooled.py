"""Pooled clients against the shipped defaults: a flood beside a steady tenant, idle expiry, a burst, a broker cut.

    python -m bench.pooled flood [--batchers 2]   # B at 20/s on one aiohttp session while A sends 5,000 at once
    python -m bench.pooled flood --steady-client own  # ... B from a client process of its own
    python -m bench.pooled idle [--calls 500]     # openai clients (max_retries=0) calling every 4.8-5.2 s
    python -m bench.pooled burst [--pool cold]    # 3,000 calls at once into an idle 400/s worker, 5 s deadline
    python -m bench.pooled burst --fresh-key      # ... the tenant's key issued a moment before (default: earlier)
    python -m bench.pooled brokercut              # 40/s, 4 s deadline, every broker connection closed mid-way

The burst's ``--pool``: ``cold`` (one session whose pool is empty, so each call opens a connection, then kept),
``warm`` (the pool holds 3,000 open connections first, as a web backend's does after a busy moment: the calls go
out without connecting), ``none`` (a new connection per call, closed after: a client without a pool) or ``lean``
(``bench/load.py``'s plain-socket client, a new connection per call, in a process of its own: 0.57 CPU-s for the
burst against aiohttp's 1.3-1.5, so that less of the two cores goes to the client). Each burst also reports
``server_429``, the service's own timing of its refusals from their arrival (:mod:`harness.refusal_times`).

Each starts its own system (gunicorn with two processes, the batcher(s), one sim worker at 250 ms per batch:
400 requests/s) with API keys on, on the local RabbitMQ and Redis, prints one JSON line per run and writes
nothing else. Clients keep connections in a pool and never retry (``harness/pooled.py``), so a connection the
server drops or closes under a request counts as an error here.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from harness import pooled, refusal_times
from harness.services import Vhost
from harness.stack import Stack
from tasks.config import Settings


def start(tmp: Path, batchers: int = 1, embed: bool = False, **env: object) -> AbstractContextManager[Stack]:
    return pooled.keyed_stack(tmp, batchers, embed, log_level="WARNING", **env)


key = pooled.key


def flood(tmp: Path, batchers: int, steady_client: str = "shared") -> dict[str, Any]:
    """``steady_client``: ``shared``, B's calls on the flood's own session (a web backend serving both tenants:
    B's times then hold that client's own delay, its event loop busy sending the flood); ``own``, B from a
    client process of its own, as another tenant's backend is (B's times are then the service's)."""
    with start(tmp, batchers) as stack:
        a, b = key(stack, "a"), key(stack, "b")

        async def run() -> tuple[list[pooled.Call], list[pooled.Call], list[pooled.Call]]:
            async with pooled.session() as http:
                alone = await pooled.steady(http, stack.url, "b", 20, 5, key=b)
                steady = asyncio.ensure_future(pooled.steady(http, stack.url, "b", 20, 10, key=b))
                await asyncio.sleep(1.0)
                flooded = await pooled.burst(stack.url, 5000, "a", key=a, timeout_ms=10_000, http=http)
                return alone, await steady, flooded

        async def run_apart() -> tuple[list[pooled.Call], list[pooled.Call], list[pooled.Call]]:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as other:
                loop = asyncio.get_running_loop()
                alone = await loop.run_in_executor(other, _steady_client, stack.url, b, 5.0)
                steady = loop.run_in_executor(other, _steady_client, stack.url, b, 10.0)
                await asyncio.sleep(1.0)
                flooded = await pooled.burst(stack.url, 5000, "a", key=a, timeout_ms=10_000)
                return alone, await steady, flooded

        alone, beside, a_calls = asyncio.run(run() if steady_client == "shared" else run_apart())
    return {"scenario": "flood", "batchers": batchers, "steady_client": steady_client,
            "b_alone": pooled.summary(alone), "b_beside_flood": pooled.summary(beside),
            "a_flood": pooled.summary(a_calls)}


def _steady_client(url: str, b_key: str, duration_s: float) -> list[pooled.Call]:
    """Tenant B at 20 calls/s for ``duration_s`` on a session of its own (in a process of its own)."""
    async def run() -> list[pooled.Call]:
        async with pooled.session() as http:
            return await pooled.steady(http, url, "b", 20, duration_s, key=b_key)

    return asyncio.run(run())


def idle(tmp: Path, calls: int, clients: int = 20) -> dict[str, Any]:
    import openai

    with start(tmp, embed=True) as stack:
        api_key = key(stack, "idle")
        errors: list[str] = []
        statuses: list[int] = []
        lock = threading.Lock()

        def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            client = openai.OpenAI(base_url=stack.url + "/v1", api_key=api_key, max_retries=0, timeout=30)
            for _ in range(calls // clients):
                try:
                    client.embeddings.create(model="all-MiniLM-L6-v2", input=f"idle {seed}")
                    outcome = 200
                except openai.APIStatusError as exc:
                    outcome = exc.status_code
                except openai.APIConnectionError as exc:
                    outcome = 0
                    with lock:
                        errors.append(f"{type(exc.__cause__ or exc).__name__}: {exc.__cause__ or exc}"[:160])
                with lock:
                    statuses.append(outcome)
                time.sleep(rng.uniform(4.8, 5.2))

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
            time.sleep(5.0 / clients)  # spread the clients over one period
        for t in threads:
            t.join()
    return {"scenario": "idle", "calls": len(statuses), "ok": statuses.count(200),
            "connection_errors": statuses.count(0), "errors": sorted(set(errors))[:5]}


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of each process of the stack (gunicorn's workers together) and of this client."""
    import os

    import psutil

    def of(pids: list[int]) -> float:
        total = 0.0
        for pid in pids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    return {"web": of(stack.web_workers()), "batcher": of([stack.pid("batcher")]),
            "worker": of([stack.pid("gpu0"), *stack.children("gpu0")]), "client": of([os.getpid()])}


def burst(tmp: Path, pool: str = "cold", n: int = 3000, fresh_key: bool = False) -> dict[str, Any]:
    """``n`` calls at once (5 s deadlines); ``server_429`` is the service's own timing of its refusals, from
    each request's arrival (:mod:`harness.refusal_times`), beside the client's from each call's start. The
    tenant's key was issued before the burst, as an existing tenant's was (:func:`tenant_key`)."""
    if pool == "lean":
        return _lean_burst(tmp, n, fresh_key)
    with start(tmp) as stack:
        a = tenant_key(stack, "a", fresh_key)

        async def run() -> tuple[list[pooled.Call], dict[str, float], dict[str, Any]]:
            async with pooled.session(per_call=pool == "none") as http:
                if pool == "warm":
                    await pooled.warm(http, stack.url, n)
                before, timed = cpu_seconds(stack), refusal_times.scrape(stack.url)
                calls = await pooled.burst(stack.url, n, "a", key=a, timeout_ms=5000, http=http)
                server = refusal_times.refusals_since(timed, refusal_times.scrape(stack.url))
                return calls, {k: round(v - before[k], 2) for k, v in cpu_seconds(stack).items()}, server

        calls, cpu, server = asyncio.run(run())
    return {"scenario": "burst", "pool": pool, "fresh_key": fresh_key, **pooled.summary(calls), "server_429": server,
            "cpu_s": cpu}


def tenant_key(stack: Stack, tenant: str, fresh: bool = False) -> str:
    """A key for ``tenant``: issued a moment before the burst (``fresh``: its first calls look it up, and each API
    process's key index holds it only from its next load), or as an existing tenant's was, before the processes'
    last load of their key index (they load it every ``LLMB_AUTH_CACHE_S``): the door then knows it on arrival."""
    issued = key(stack, tenant)
    if not fresh:
        time.sleep(Settings.from_env().tenants.auth_cache_s + 1.0)
    return issued


def _lean_burst(tmp: Path, n: int, fresh_key: bool = False) -> dict[str, Any]:
    """The burst from ``bench/load.py``'s client in a process of its own: plain sockets, a new connection per
    call, 0.57 CPU-s for the burst against aiohttp's 1.3-1.5 (``cpu_s``'s ``client``). On two shared cores
    less of each call's time is then the client's own, as with a client on a host of its own."""
    with start(tmp) as stack:
        a = tenant_key(stack, "a", fresh_key)
        before, timed = cpu_seconds(stack), refusal_times.scrape(stack.url)
        out = tmp / "lean.json"
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the client is the only child waited for
        subprocess.run([sys.executable, "-m", "bench.load", "--url", stack.url, "--key", a, "--timeout-ms", "5000",
                        "--rate", str(n * 100), "--count", str(n), "--out", str(out)],  # n in about 10 ms
                       check=True, capture_output=True, cwd=Path(__file__).resolve().parent.parent)
        server = refusal_times.refusals_since(timed, refusal_times.scrape(stack.url))
        client = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = {k: round(v - before[k], 2) for k, v in cpu_seconds(stack).items() if k != "client"}
        cpu["client"] = round(client.ru_utime + client.ru_stime - children.ru_utime - children.ru_stime, 2)
    records = json.loads(out.read_text())["records"]
    ok = [r["ms"] / 1000 for r in records if r["status"] == 200]
    refused = [r["ms"] / 1000 for r in records if r["status"] == 429]
    return {"scenario": "burst", "pool": "lean", "fresh_key": fresh_key, "calls": len(records),
            "statuses": dict(sorted(collections.Counter(str(r["status"]) for r in records).items())),
            "p50_s": pooled.quantile_s(ok, 50), "p99_s": pooled.quantile_s(ok, 99),
            "p99_429_s": pooled.quantile_s(refused, 99), "server_429": server, "cpu_s": cpu}


def brokercut(tmp: Path) -> dict[str, Any]:
    vhost = Vhost().create()
    try:
        calls = _cut_under_load(tmp, vhost)
    finally:
        vhost.delete()  # after the stack has closed: closing it removes its queues, in the vhost
    late = [c for c in calls if c.status == 200 and c.latency_s > 4.0 + 1.0]
    return {"scenario": "brokercut", **pooled.summary(calls), "late_200": len(late),
            "504_sent_after_cut": sum(1 for c in calls if c.status == 504 and c.tenant == "after")}


def _cut_under_load(tmp: Path, vhost: Vhost) -> list[pooled.Call]:
    """40 calls/s on one pooled session for 14 s; at 5 s every connection of the stack's vhost is closed."""
    with start(tmp, broker_url=vhost.url) as stack:
        k = key(stack, "cut")

        async def run() -> list[pooled.Call]:
            async with pooled.session() as http:
                load = asyncio.ensure_future(pooled.steady(http, stack.url, "cut", 40, 14, key=k, timeout_ms=4000))
                await asyncio.sleep(5.0)
                cut_at = time.monotonic()
                await asyncio.to_thread(vhost.close_connections)
                calls = await load
                for c in calls:
                    c.tenant = "after" if c.sent_at >= cut_at else "before"
                return calls

        return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["flood", "idle", "burst", "brokercut"])
    parser.add_argument("--batchers", type=int, default=1)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--pool", choices=["cold", "warm", "none", "lean"], default="cold",
                        help="burst: the client's connections (see above)")
    parser.add_argument("--fresh-key", action="store_true",
                        help="burst: the tenant's key issued a moment before (default: before the API processes' last "
                             "load of their key index, as an existing tenant's)")
    parser.add_argument("--steady-client", choices=["shared", "own"], default="shared",
                        help="flood: B on the flood's own session, or from a client process of its own")
    args = parser.parse_args()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="llmb-pooled-") as tmp:
            if args.scenario == "flood":
                row = flood(Path(tmp), args.batchers, args.steady_client)
            elif args.scenario == "idle":
                row = idle(Path(tmp), args.calls)
            elif args.scenario == "burst":
                row = burst(Path(tmp), args.pool, fresh_key=args.fresh_key)
            else:
                row = brokercut(Path(tmp))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
