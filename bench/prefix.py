"""Prefix-aware routing against least-backlog routing: the shape of llm-d's precise prefix-cache experiment, scaled
to this machine.

    python -m bench.prefix                     # about 10 minutes on 2 cores; a Markdown table on stdout
    python -m bench.prefix --json report.json

The fleet: ``--workers`` sim-lm workers (continuous batching, Llama-2-7B on an A100 timing, each with a KV cache
of ``--kv-tokens`` and its prefix cache), one batcher, gunicorn. The traffic: ``--tenants`` tenants, each with a
system prompt of about ``--prefix-tokens`` tokens of its own; every call is a streamed chat completion (``stream``
with ``include_usage``) of one tenant chosen at random, its system prompt and a short question of its own, and
``--max-tokens`` to generate. Arrivals are Poisson at each of ``--loads`` percent of the fleet's capacity, the
same trace (same seed) for both routings: ``LLMB_PREFIX_ROUTING=false`` (today's least-backlog rule) and
``true``. Every (routing, load) run starts a fresh system, so every cache starts cold.

The capacity is measured first, with each routing: one call per tenant (its start cached), then
``--capacity-calls`` calls of the same traffic sent at once, completed calls over the time to the last answer.
The loads are shares of the larger of the two, the fleet's capacity when its caches are used well
(prefix-aware routing), as llm-d's experiment raised its load to where the better router saturates: at 100%
least-backlog is past its own capacity, and the output tokens/s tell how much of the offered load each
routing serves.

Reported per run, in modelled time (wall time x ``--speed``, the sim-lm speed-up; 1 by default):
time to first token (p50/p90/p99), output tokens per second (the workers' own counts, from the usage chunks),
the prefix-cache hit rate (prompt pages found cached over those looked up, from the workers' heartbeats),
each worker's share of the prompt and output tokens (max over mean), and each tenant's tokens served over
tokens asked for (max over min: 1 is perfectly fair).
"""
from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import random
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench.run import machine
from harness.stack import Stack, running_stack, wait_for
from harness.stats import percentile, rounded

WORDS = ("policy", "travel", "expense", "hotel", "train", "flight", "receipt", "manager", "approve", "limit",
         "budget", "client", "meeting", "report", "claim", "invoice", "booking", "refund", "class", "meal")


def system_prompt(tenant: int, tokens: int) -> str:
    """A tenant's own long instructions: words of up to 6 letters are a token each in sim-lm's tokenizer (and a
    space another), so ``tokens`` / 2 words; the first differs per tenant, so tenants share nothing."""
    rng = random.Random(tenant)
    return f"Tenant {tenant} rules. " + " ".join(rng.choice(WORDS) for _ in range(tokens // 2))


def trace(n: int, rate: float, tenants: int, seed: int) -> list[dict[str, Any]]:
    """``n`` calls at Poisson times (modelled seconds) at ``rate`` per second, each of a random tenant."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        tenant = rng.randrange(tenants)
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
        out.append({"i": i, "t": t, "tenant": tenant, "question": f"question {i}: {question}?"})
        t += rng.expovariate(rate)
    return out


def chat(url: str, body: dict[str, Any], tenant: str, timeout_s: float) -> dict[str, Any]:
    """One streamed chat call: its status, ms to the first content and to the end, the tokens it used."""
    target = urlparse(url)
    rec: dict[str, Any] = {"status": None, "ttft_ms": None, "latency_ms": None, "usage": None}
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=timeout_s)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Tenant": tenant})
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            rec["error"] = resp.read()[:200].decode(errors="replace")
            return rec
        for line in iter(resp.readline, b""):
            if not line.startswith(b"data: "):
                continue
            now = (time.monotonic() - started) * 1000
            if line[6:].strip() == b"[DONE]":
                rec["latency_ms"] = now
                break
            event = json.loads(line[6:])
            if event.get("usage"):
                rec["usage"] = event["usage"]
            if rec["ttft_ms"] is None and any(c["delta"].get("content") for c in event.get("choices", ())):
                rec["ttft_ms"] = now
        conn.close()
    except OSError as exc:
        rec["status"] = type(exc).__name__
    return rec


def drive(stack: Stack, calls: list[dict[str, Any]], args: argparse.Namespace, at_once: bool = False) -> float:
    """Offer the calls open loop (or all at once), one thread each; fills each call's record; the wall seconds
    from the first sending to the last answer."""
    prompts = {t: system_prompt(t, args.prefix_tokens) for t in {c["tenant"] for c in calls}}
    threads = []
    t0 = time.monotonic()

    def one(c: dict[str, Any]) -> None:
        body = {"model": "sim-lm", "max_tokens": args.max_tokens, "stream": True, "temperature": 0.7,
                "seed": c["i"], "stream_options": {"include_usage": True}, "timeout_ms": 120_000,
                "messages": [{"role": "system", "content": prompts[c["tenant"]]},
                             {"role": "user", "content": c["question"]}]}
        c["rec"] = chat(stack.url, body, f"tenant{c['tenant']}", 150)
        c["rec"]["done_s"] = time.monotonic() - t0

    for c in calls:
        if not at_once:
            delay = t0 + c["t"] / args.speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        th = threading.Thread(target=one, args=(c,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=200)
    return max((c["rec"]["done_s"] for c in calls if "rec" in c), default=time.monotonic() - t0)


def fleet_stack(tmp: Path, args: argparse.Namespace, routing: bool) -> Any:
    workers = [(d, {"backend": "sim-lm", "sim_lm_kv_tokens": args.kv_tokens, "sim_lm_speed": args.speed})
               for d in range(args.workers)]
    wait = {} if args.prefix_wait_ms is None else {"prefix_wait_ms": args.prefix_wait_ms}
    return running_stack(tmp, workers=workers, web_workers=2, auth="none", prefix_routing=routing,
                         max_tokens_cap=max(256, args.max_tokens), log_level="WARNING", **wait)


def heartbeats(stack: Stack) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in stack.fleet().items() if v.get("model") == "sim-lm"}


def shares(stack: Stack) -> tuple[dict[str, int], dict[str, int]]:
    """Prompt + completion tokens by worker and by tenant, from the ledger."""
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from tasks.store.models import BatchRecord, RequestRecord

    engine = create_engine(stack.database_url)
    try:
        with Session(engine) as session:
            rows = session.execute(select(BatchRecord.worker, RequestRecord.tenant, RequestRecord.prompt_tokens,
                                          RequestRecord.completion_tokens)
                                   .join(BatchRecord, BatchRecord.id == RequestRecord.batch_id)
                                   .where(RequestRecord.status == "ok")).all()
    finally:
        engine.dispose()
    by_worker: dict[str, int] = defaultdict(int)
    by_tenant: dict[str, int] = defaultdict(int)
    for worker, tenant, prompt, completion in rows:
        by_worker[worker or "?"] += (prompt or 0) + (completion or 0)
        by_tenant[tenant] += (prompt or 0) + (completion or 0)
    return dict(by_worker), dict(by_tenant)


def run(args: argparse.Namespace, routing: bool, calls: list[dict[str, Any]], at_once: bool = False) -> dict[str, Any]:
    """One fresh system serving ``calls``; ``at_once``: a capacity run, every tenant's start cached first."""
    calls = [dict(c) for c in calls]
    with tempfile.TemporaryDirectory(prefix="llmb-prefix-") as tmp, fleet_stack(Path(tmp), args, routing) as stack:
        if at_once:  # one call per tenant first, so that the burst measures a fleet in its steady state
            warm = [{"i": -1 - t, "t": 0.0, "tenant": t, "question": "warm-up?"} for t in range(args.tenants)]
            drive(stack, warm, args, at_once=True)
        wall = drive(stack, calls, args, at_once)
        ok = [c for c in calls if c.get("rec", {}).get("status") == 200 and c["rec"]["usage"]]
        wait_for(lambda: sum(int(b.get("prefix_queries") or 0) for b in heartbeats(stack).values()) > 0
                 and len(shares(stack)[1]) > 0, 20, "the run's heartbeats and ledger")
        time.sleep(2.5)  # one more heartbeat and ledger flush after the last answer
        beats = heartbeats(stack)
        by_worker, by_tenant = shares(stack)
    speed = args.speed
    ttft = [c["rec"]["ttft_ms"] * speed for c in ok if c["rec"]["ttft_ms"] is not None]
    output = sum(c["rec"]["usage"]["completion_tokens"] for c in ok)
    queries = sum(int(b.get("prefix_queries") or 0) for b in beats.values())
    hits = sum(int(b.get("prefix_hits") or 0) for b in beats.values())
    asked: dict[str, int] = defaultdict(int)
    for c in ok:
        asked[f"tenant{c['tenant']}"] += c["rec"]["usage"]["total_tokens"]
    served = {t: by_tenant.get(t, 0) / n for t, n in asked.items() if n}
    mean_worker = sum(by_worker.values()) / max(1, args.workers)
    return {
        "routing": "prefix-aware" if routing else "least-backlog", "calls": len(calls), "ok": len(ok),
        "wall_s": round(wall, 1), "calls_per_s": round(len(ok) / (wall * speed), 2),
        "ttft_ms": {f"p{p}": rounded(percentile(ttft, p), 0) for p in (50, 90, 99)},
        "output_tokens_per_s": round(output / (wall * speed), 1),
        "prefix_hit_rate": round(hits / queries, 3) if queries else None,
        "worker_tokens": by_worker, "worker_max_over_mean": round(max(by_worker.values()) / mean_worker, 2)
        if by_worker and mean_worker else None,
        "tenant_served_over_asked_max_over_min": round(max(served.values()) / min(served.values()), 3)
        if served and min(served.values()) > 0 else None,
    }


def markdown(report: dict[str, Any]) -> str:
    cap = report["capacity"]
    lines = [f"Capacity ({cap['least-backlog']['calls']} calls at once, modelled time): least-backlog "
             f"{cap['least-backlog']['calls_per_s']} calls/s, prefix-aware {cap['prefix-aware']['calls_per_s']} "
             f"calls/s; 100% = **{report['capacity_calls_per_s']} calls/s**", "",
             "| load | routing | TTFT p50 | p90 | p99 (ms) | output tok/s | prefix hits | worker max/mean "
             "| tenant served/asked max/min | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["runs"]:
        t = row["ttft_ms"]
        lines.append(f"| {row['load']}% | {row['routing']} | {t['p50']} | {t['p90']} | {t['p99']} | "
                     f"{row['output_tokens_per_s']} | {row['prefix_hit_rate']:.0%} | {row['worker_max_over_mean']} | "
                     f"{row['tenant_served_over_asked_max_over_min']} | {row['ok']}/{row['calls']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--prefix-tokens", type=int, default=3000)
    ap.add_argument("--kv-tokens", type=int, default=24_000,
                    help="per worker: a third of the tenants' starts (least backlog spreads every tenant everywhere)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--calls", type=int, default=720, help="calls per (routing, load) run")
    ap.add_argument("--capacity-calls", type=int, default=160)
    ap.add_argument("--loads", type=int, nargs="+", default=[50, 80, 100])
    ap.add_argument("--speed", type=float, default=0.5,
                    help="LLMB_SIM_LM_SPEED (0.5: the device at half speed, so that it, not this CPU, is the limit)")
    ap.add_argument("--prefix-wait-ms", type=float, help="LLMB_PREFIX_WAIT_MS (default: the shipped default)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    started = time.monotonic()
    burst = trace(args.capacity_calls, 1.0, args.tenants, args.seed + 1)
    capacity = {name: run(args, routing, burst, at_once=True)
                for name, routing in (("least-backlog", False), ("prefix-aware", True))}
    fleet = max(c["calls_per_s"] for c in capacity.values())
    report: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
                              "config": {k: v for k, v in vars(args).items() if k != "json"},
                              "capacity": capacity, "capacity_calls_per_s": fleet, "runs": []}
    for load in args.loads:
        calls = trace(args.calls, fleet * load / 100, args.tenants, args.seed)
        for routing in (False, True):
            report["runs"].append({"load": load, **run(args, routing, calls)})
    report["wall_s"] = round(time.monotonic() - started, 1)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
