"""Hostile callers against the default system, one scenario at a time (issue 43, item 9): what they are answered,
what they cost the API processes' memory, and what they cost a steady caller beside them.

    python -m bench.hostile [--calls 10000] [--only NAME ...] [--out bench/results/hostile]   # ~6 minutes

Each scenario starts its own system as bin/run does (gunicorn with 2 processes, the batcher, a sim worker for
/v1/infer and a sim-lm worker for the OpenAI routes; API keys on where the scenario needs them; not the embedding
worker or Flower) on the local RabbitMQ and Redis, and a PostgreSQL database of its own (``LLMB_TEST_POSTGRES``,
as the tests' fixture: the SQL store's size is measured there). A steady caller sends /v1/infer calls one after
another (40 alone, then for as long as the hostile calls run); the hostile calls come from a process of their
own, on pooled connections with retries off (:mod:`harness.hostile`):

- made-up models: calls naming a model no worker serves (half /v1/infer, half chat);
- random keys: calls with random bearer tokens (keys on);
- hostile numbers: every case of :func:`harness.hostile.number_cases` in turn (keys on);
- pipelined: 10 requests per connection in one write (a fifth made-up models, a fifth invalid);
- slow readers: long streams whose clients never read, then resumes of one call by clients that never read
  (fewer: each holds its stream until the send timeout, 30 s by default);
- job create-and-cancel: one tenant creates a batch of one file and cancels it, in a loop (fewer: each round
  waits for its lines to be written); the SQL store's size before and after.

Memory is VmRSS of the gunicorn workers, read after a warm-up of 5% of the calls and after the last, and given per
10,000 hostile calls. Prints a markdown table and writes it with the figures (report.json) to ``--out``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import requests

from harness import hostile
from harness.stack import Stack, running_stack, wait_for
from harness.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN = os.environ.get("LLMB_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
BATCH_TABLES = ("batch_jobs", "batch_lines", "files")
SOLO = 40  # the steady caller's calls alone


@contextmanager
def database() -> Iterator[str]:
    """A PostgreSQL database of its own (the SQLAlchemy URL), dropped after."""
    name = f"llmb_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_ADMIN.rsplit('/', 1)[0].replace('postgresql://', 'postgresql+psycopg://')}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def store_bytes(url: str) -> int:
    """The batch tables' size with their indexes and TOAST (pg_total_relation_size)."""
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        row = conn.execute("SELECT sum(pg_total_relation_size(c)) FROM unnest(%s::regclass[]) AS c",
                           [list(BATCH_TABLES)]).fetchone()
    return int(row[0] or 0) if row else 0


def store_rows(url: str) -> dict[str, int]:
    """The batch tables' live rows and dead row versions (PostgreSQL's statistics: what VACUUM has yet to free)."""
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        rows = conn.execute("SELECT sum(n_live_tup), sum(n_dead_tup) FROM pg_stat_user_tables WHERE relname = ANY(%s)",
                            [list(BATCH_TABLES)]).fetchone()
        lines = conn.execute("SELECT count(*) FROM batch_lines").fetchone()
    return {"batch_lines": int(lines[0]) if lines else 0, "live": int(rows[0] or 0) if rows else 0,
            "dead": int(rows[1] or 0) if rows else 0}


# -- the hostile calls (module level: they run in the flood's own process) -----------------------------------------
def _made_up(url: str, session: requests.Session, i: int) -> list[str]:
    return [hostile.answer_of(hostile.made_up_call(session, url, i))]


def _random_key(url: str, session: requests.Session, i: int) -> list[str]:
    return [str(hostile.random_token_call(session, url).status_code)]


def _number(url: str, keys: dict[str, str], session: requests.Session, i: int) -> list[str]:
    cases = _cases()
    case = cases[i % len(cases)]
    r = hostile.number_call(session, url, case, {"Authorization": f"Bearer {keys['admin' if case.admin else 'key']}"})
    answer = hostile.answer_of(r)
    if case.taken:
        return [answer if r.status_code == 200 else f"{answer} (wrong)"]
    named = answer.startswith("400 ") and case.named_in(r.json()["error"]["message"])
    return [answer if named else f"{answer} (wrong)"]


@functools.cache
def _cases() -> list[hostile.NumberCase]:
    return hostile.number_cases()


def _pipelined(port: int, session: requests.Session, i: int) -> list[str]:
    return hostile.pipelined(port, f"pipe-{i}-{uuid.uuid4().hex[:8]}")


def run_flood(call: Callable[[requests.Session, int], list[str]], calls: int, threads: int) -> dict[str, int]:
    with ProcessPoolExecutor(1) as pool:
        return pool.submit(hostile.flood, call, calls, threads).result()


# -- one scenario ---------------------------------------------------------------------------------------------------
def measured(stack: Stack, name: str, hostile_calls: int, run: Callable[[int], dict[str, int]],
             steady_headers: dict[str, str] | None = None, warm_up: int = 0) -> dict[str, Any]:
    """The steady caller alone, then beside ``run(calls)`` (after ``run(warm_up)``); memory and answers."""
    hostile.steady_calls(stack.url, steady_headers, count=5)
    solo, _ = hostile.steady_calls(stack.url, steady_headers, count=SOLO)
    if warm_up:
        run(warm_up)
    pids = stack.web_workers()
    before = hostile.rss_kib(pids)
    with ThreadPoolExecutor(1) as pool:  # (a flood of calls runs in a process of its own: run_flood)
        started = time.monotonic()
        flooding = pool.submit(run, hostile_calls)
        beside, statuses = hostile.steady_calls(stack.url, steady_headers, until=flooding.done)
        answers = flooding.result()
        took = time.monotonic() - started
    growth = hostile.rss_kib(pids) - before
    row = {"scenario": name, "calls": hostile_calls, "answers": answers, "seconds": round(took, 1),
           "rss_before_mib": round(before / 1024, 1), "rss_growth_mib": round(growth / 1024, 2),
           "mib_per_10k": round(growth / 1024 * 10_000 / hostile_calls, 2),
           "solo_p50": percentile(solo, 50), "solo_p99": percentile(solo, 99), "beside": len(beside),
           "beside_statuses": {str(k): v for k, v in statuses.items()},
           "beside_p50": percentile(beside, 50), "beside_p99": percentile(beside, 99)}
    print(json.dumps(row), flush=True)
    return row


def made_up_models(tmp: Path, calls: int) -> dict[str, Any]:
    with running_stack(tmp / "made-up", workers=[0, (1, {"backend": "sim-lm"})]) as stack:
        run = functools.partial(run_flood, functools.partial(_made_up, stack.url), threads=8)
        return measured(stack, "random model names", calls, run, warm_up=calls // 20)


def random_keys(tmp: Path, calls: int) -> dict[str, Any]:
    with running_stack(tmp / "random-keys", workers=[0, (1, {"backend": "sim-lm"})], auth="keys") as stack:
        steady = {"Authorization": "Bearer " + stack.admin("keys", "create", "steady").stdout.strip()}
        run = functools.partial(run_flood, functools.partial(_random_key, stack.url), threads=200)
        return measured(stack, "random bearer tokens (keys on)", calls, run, steady, warm_up=calls // 20)


def numbers(tmp: Path, calls: int) -> dict[str, Any]:
    with running_stack(tmp / "numbers", workers=[0, (1, {"backend": "sim-lm"})], auth="keys") as stack:
        keys = {"key": stack.admin("keys", "create", "hostile").stdout.strip(),
                "admin": stack.admin("keys", "create", "ops", "--admin").stdout.strip()}
        steady = {"Authorization": "Bearer " + stack.admin("keys", "create", "steady").stdout.strip()}
        run = functools.partial(run_flood, functools.partial(_number, stack.url, keys), threads=8)
        row = measured(stack, f"huge/non-finite numbers ({len(_cases())} cases, keys on)", calls, run, steady,
                       warm_up=len(_cases()))
        return row


def pipelined(tmp: Path, calls: int) -> dict[str, Any]:
    with running_stack(tmp / "pipelined", workers=[0, (1, {"backend": "sim-lm"})]) as stack:
        run = functools.partial(run_flood, functools.partial(_pipelined, stack.port), threads=8)
        # (a call of the flood is one connection of 10 requests)
        row = measured(stack, "pipelined requests (10 per connection)", calls // 10, run, warm_up=calls // 200)
        row["calls"] = sum(row["answers"].values())
        row["mib_per_10k"] = round(row["rss_growth_mib"] * 10_000 / max(1, row["calls"]), 2)
        return row


def slow_readers(tmp: Path, calls: int) -> dict[str, Any]:
    """``calls`` long streams read by nobody, held past the send timeout; then as many resumes of one call by
    clients that read nothing (one tenant: all but MAX_RESUMING_PER_TENANT of them at once refused)."""
    # (the sim-lm worker without its random EOS, as tests/test_hostile_conn.py runs it: every stream its max_tokens,
    # long enough to fill what a reader that reads nothing leaves room for)
    with running_stack(tmp / "slow", workers=[0, (1, {"backend": "sim-lm"})], sim_lm_eos_mean=0) as stack:
        # (after a first round of as many: what a round leaves behind, not the allocator's first growth)
        return measured(stack, "slow stream readers and resumes", 2 * calls,
                        functools.partial(_slow, stack.port, stack.url), warm_up=2 * calls)


def _slow(port: int, url: str, calls: int) -> dict[str, int]:
    half = calls // 2
    held = [hostile.slow_reader(port, hostile.chat_request(f"slow-{uuid.uuid4().hex}", max_tokens=1000,
                                                            stream=True)) for _ in range(half)]
    rid = f"resumed-{uuid.uuid4().hex}"
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=60, headers={"X-Request-Id": rid}, json={
            "model": "sim-lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000,
            "stream": True}) as r:
        next(r.iter_lines())  # its client leaves after its first event: the call runs on, resumable
    resume = f"GET /v1/requests/{rid}/stream HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    held += [hostile.slow_reader(port, resume) for _ in range(half)]
    time.sleep(35)  # past the send timeout (30 s): every stream given up by the server
    answers: dict[str, int] = {}
    for sock in held:
        sock.setblocking(False)
        try:
            head = sock.recv(64)
        except BlockingIOError:
            head = b""
        status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "no answer read"
        answers[status] = answers.get(status, 0) + 1
        sock.close()
    return answers


def jobs(tmp: Path, rounds: int, lines: int = 2000) -> dict[str, Any]:
    with database() as url, running_stack(tmp / "jobs", workers=[0, (1, {"backend": "sim-lm"})], jobs=("jobs",),
                                          auth="keys", database_url=url, files_dir=tmp / "jobs" / "files") as stack:
        steady = {"Authorization": "Bearer " + stack.admin("keys", "create", "steady").stdout.strip()}
        tenant = hostile.Tenant(stack.url, stack.admin("keys", "create", "hostile").stdout.strip())
        file_id = tenant.upload(lines)
        sizes = [store_bytes(url)]

        def loop(n: int) -> dict[str, int]:
            answers: dict[str, int] = {}
            for _ in range(n):
                r = tenant.create(file_id)
                answers[str(r.status_code)] = answers.get(str(r.status_code), 0) + 1
                if r.status_code != 200:
                    continue
                batch = r.json()["id"]
                wait_for(lambda: tenant.status(batch) in ("in_progress", "completed", "failed"), 60,  # noqa: B023
                         "its lines written")
                tenant.cancel(batch)
                wait_for(lambda: tenant.status(batch) in ("cancelled", "completed", "failed"), 60,  # noqa: B023
                         "cancelled")
                sizes.append(store_bytes(url))
            return answers

        row = measured(stack, f"job create-and-cancel ({lines}-line file)", rounds, loop, steady)
        row["store_mib"] = [round(s / 2**20, 2) for s in (sizes[0], sizes[len(sizes) // 2], sizes[-1])]
        row["store_rows"] = store_rows(url)
        # what autovacuum would do (off on some hosts, this one's included): one VACUUM, then as many rounds again
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
            conn.execute(f"VACUUM {', '.join(BATCH_TABLES)}")
        vacuumed = len(sizes)
        loop(rounds)
        row["after_vacuum_mib"] = [round(s / 2**20, 2) for s in (sizes[vacuumed - 1], sizes[-1])]
        print(json.dumps({"store_bytes": sizes}), flush=True)
        return row


SCENARIOS: dict[str, Callable[[Path, int], dict[str, Any]]] = {
    "made-up": made_up_models, "keys": random_keys, "numbers": numbers, "pipelined": pipelined,
    "slow": lambda tmp, calls: slow_readers(tmp, min(calls, 100)),
    "jobs": lambda tmp, calls: jobs(tmp, min(calls, 20))}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| scenario | hostile calls | answers | API RSS growth (MiB) | steady p50/p99 solo (ms) | "
           "steady p50/p99 beside (ms), calls | SQL store (MiB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(r["answers"].items(), key=lambda kv: -kv[1]))
        store = ""
        if "store_mib" in r:
            found = r["store_rows"]
            store = (" → ".join(str(s) for s in r["store_mib"]) + f" (before, middle, last round; then "
                     f"{found['batch_lines']} lines, {found['dead']:,} dead row versions); after one VACUUM, "
                     f"{r['calls']} rounds more: " + " → ".join(str(s) for s in r["after_vacuum_mib"]))
        beside = "" if set(r["beside_statuses"]) == {"200"} else f" ({r['beside_statuses']})"
        scaled = f" ({r['mib_per_10k']:+.2f} per 10,000)" if r["calls"] >= 1000 else ""  # (not from a few calls)
        out.append(f"| {r['scenario']} | {r['calls']:,} in {r['seconds']} s | {answers} | "
                   f"{r['rss_growth_mib']:+.2f} over {r['calls']:,}{scaled} | "
                   f"{r['solo_p50']:.0f} / {r['solo_p99']:.0f} | {r['beside_p50']:.0f} / {r['beside_p99']:.0f}, "
                   f"{r['beside']}{beside} | {store} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10_000, help="hostile calls per scenario (fewer where noted)")
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="these scenarios only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hostile"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [SCENARIOS[name](out / "run", args.calls) for name in (args.only or SCENARIOS)]
    report = table(rows)
    (out / "report.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
