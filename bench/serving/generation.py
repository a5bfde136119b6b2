"""One generation run of the LLM benchmark: one sim-lm worker (continuous or static) serving the sequence of calls,
and its figures (latency, TTFT, throughput, the cost report), rescaled to the modelled device's time."""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from typing import Any

from bench.serving.arrivals import drive
from bench.serving.ledger import batch_members, ledger_batches
from bench.serving.sse import stream_completion
from bench.serving.workers import admin_stats, counters, start_worker, stop_worker, wait_idle, worker_id
from harness.stack import Stack, wait_for
from harness.stats import percentile, rounded

MODES = ("continuous", "static")
LM_DEVICE = {"continuous": 0, "static": 1}
SLOTS_DEVICE = 3  # the continuous run with more slots (--slots)


def static_model_s(calls: list[dict[str, Any]], speed: float) -> float:
    """What sim-lm's model says one static batch of ``calls`` takes (wall seconds at ``speed``): split as the
    backend splits it to fit the KV cache, each part padded to its longest prompt and its largest max_tokens."""
    from gpu_worker.backends.sim_lm_engine import Timing, static_time_ms
    from gpu_worker.backends.sim_lm_text import SimTokenizer
    from tasks.config import Settings

    s = Settings.from_env()
    timing = Timing(s.sim.lm_prefill_ms_per_token, s.sim.lm_step_ms, s.sim.lm_step_ms_per_seq)
    tok = SimTokenizer()
    rows = [(len(tok.encode(c["prompt"])), c["max_tokens"]) for c in calls]
    groups: list[list[tuple[int, int]]] = []
    for row in rows:
        if groups and len(groups[-1]) < s.sim.lm_max_seqs and \
                (len(groups[-1]) + 1) * max(p + n for p, n in [*groups[-1], row]) <= s.sim.lm_kv_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    return sum(static_time_ms([p for p, _ in g], [n for _, n in g], timing) for g in groups) / 1000 / speed


def union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def variants(args: argparse.Namespace) -> list[tuple[str, str, int, dict[str, object]]]:
    """(name, mode, device, worker settings) of each generation run."""
    out: list[tuple[str, str, int, dict[str, object]]] = [(m, m, LM_DEVICE[m], {}) for m in args.modes]
    if args.slots and "continuous" in args.modes:
        out.append((f"continuous, {args.slots} slots", "continuous", SLOTS_DEVICE, {"sim_lm_slots": args.slots}))
    return out


def run_lm(stack: Stack, name: str, mode: str, device: int, env: dict[str, object], calls: list[dict[str, Any]],
           args: argparse.Namespace) -> dict[str, Any]:
    """Serve ``calls`` with one sim-lm worker in ``mode``; the run's figures, rescaled to modelled time."""
    speed = args.speed
    wid = worker_id(device)
    start_worker(stack, device, "sim-lm", {"sim_lm_mode": mode, "sim_lm_speed": speed, **env})
    try:
        earlier = sum(b[3] for b in ledger_batches(stack, wid))
        for i in range(2):  # warm-up: the batcher's and the worker's first batches, outside the figures
            warm = stream_completion(stack.url, {"model": "sim-lm", "prompt": f"warm-up {i}", "max_tokens": 4,
                                                 "stream": True, "temperature": 0}, 60, f"warm-{mode}-{i}")
            if warm["status"] != 200:
                raise RuntimeError(f"the warm-up call failed: {warm}")
        wait_idle(stack, device)
        # a streamed caller is answered before its batch's ledger record is written: wait for the warm-up's
        # records, or a late one would count as a batch of the run
        before: list[tuple[str, float, float, int]] = []

        def warmed() -> bool:
            nonlocal before
            before = ledger_batches(stack, wid)
            return sum(b[3] for b in before) >= earlier + 2

        wait_for(warmed, 10, "the warm-up's batches in the ledger")
        before_ids = {b[0] for b in before}
        c0 = counters(stack)
        admin: dict[str, Any] = {}
        window = calls[-1]["t"] / speed if calls else 0.0
        admin_thread = admin_stats(stack, window * 0.8, admin) if window > 2 else None
        tag = "".join(ch if ch.isalnum() else "-" for ch in name)
        result = drive(stack.url, calls, speed, args.timeout_ms, f"{tag}-{stack.namespace}")
        if admin_thread is not None:
            admin_thread.join(timeout=120)
        wait_idle(stack, device)
        c1 = counters(stack)
        records = result["records"]
        ok = [r for r in records if r.get("status") == 200 and r.get("latency_ms") is not None]
        # the ledger is written in the background: wait for every batch of the run to be there
        batches: list[tuple[str, float, float, int]] = []

        def recorded() -> bool:
            nonlocal batches
            batches = [b for b in ledger_batches(stack, wid) if b[0] not in before_ids]
            return sum(b[3] for b in batches) >= len(ok)

        with contextlib.suppress(TimeoutError):
            wait_for(recorded, 10, "the run's batches in the ledger")
    finally:
        stop_worker(stack, device)
    summary = summarize_lm(mode, args, records, ok, result, c0, c1, batches, admin)
    if mode == "static" and batches:  # how faithfully this (2-core, shared) machine ran the modelled device
        members = batch_members(stack, {b[0] for b in batches})
        by_tag = {f"{tag}-{stack.namespace}-{c['i']}": c for c in calls}
        ran = [(b, [by_tag[m] for m in members.get(b[0], []) if m in by_tag]) for b in batches]
        measured = sum(b[2] - b[1] for b, cs in ran if cs)
        modelled = sum(static_model_s(sorted(cs, key=lambda c: c["i"]), speed) for _, cs in ran if cs)
        summary["static_device_time_measured_over_modelled"] = round(measured / modelled, 3) if modelled else None
    summary.update(name=name, slots=int(str(env.get("sim_lm_slots", 4 if mode == "continuous" else 1))))
    return summary


def summarize_lm(mode: str, args: argparse.Namespace, records: list[dict[str, Any]], ok: list[dict[str, Any]],
                 result: dict[str, Any], c0: dict[str, float], c1: dict[str, float],
                 batches: list[tuple[str, float, float, int]], admin: dict[str, Any]) -> dict[str, Any]:
    from tasks.config import Settings

    speed = args.speed
    price = Settings.from_env().models.device_price_per_hour
    wall = max(result["wall_s"], 1e-9)  # first call sent to last answer, wall seconds
    device_s = wall * speed  # the same span on the modelled device
    tokens = c1["tokens"] - c0["tokens"]  # prompt + output tokens, as the worker counts them
    output = sum(r["max_tokens"] if r["finish_reason"] == "length" else r["chunks"] for r in ok)
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1

    def q(key: str, p: float, rows: list[dict[str, Any]] = ok) -> float | None:
        value = percentile([r[key] for r in rows if r.get(key) is not None], p)
        return rounded(None if value is None else value * speed, 0)

    short = [r for r in ok if r["max_tokens"] <= 100]
    long = [r for r in ok if r["max_tokens"] > 500]
    sizes = [b[3] for b in batches]
    # the batches' own times (the ledger's, this host's clock) clipped to the run: first call sent to last answer
    lo, hi = result["epoch0"], result["epoch0"] + wall
    busy_any = union_s([(max(lo, b[1]), min(hi, b[2])) for b in batches if b[2] > lo and b[1] < hi]) / wall \
        if batches else None
    device_hours = device_s / 3600  # one worker, one device
    summary: dict[str, Any] = {
        "mode": mode, "requests": len(records), "ok": len(ok), "statuses": statuses,
        "wall_s": round(wall, 2), "device_s": round(device_s, 1),
        "output_tokens": output, "tokens": int(tokens),
        "output_tokens_per_s": round(output / device_s, 1),
        "latency_ms": {"p50": q("latency_ms", 50), "p99": q("latency_ms", 99)},
        "ttft_ms": {"p50": q("ttft_ms", 50), "p99": q("ttft_ms", 99)},
        "last_token_ms": {"p50": q("last_token_ms", 50), "p99": q("last_token_ms", 99)},
        "latency_short_ms": {"p50": q("latency_ms", 50, short), "n": len(short)},  # max_tokens <= 100
        "latency_long_ms": {"p50": q("latency_ms", 50, long), "n": len(long)},  # max_tokens > 500
        "batches": len(batches), "mean_batch_size": rounded(statistics.mean(sizes)) if sizes else None,
        # streams that got fewer text chunks than tokens: deltas published before the API process listened
        # for them were lost (the final chunk then carries the text)
        "streams_missing_deltas": sum(1 for r in ok
                                      if r["finish_reason"] == "length" and r["chunks"] < r["max_tokens"]),
        "generator_lag_ms": result["lag_ms"],
        # every call as the client saw it, wall-clock ms from its sending (not rescaled)
        "records": [{k: (rounded(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in records],
        "cost": {
            "price_per_device_hour": price,
            "tokens_per_s": round(tokens / device_s, 1),
            "output_tokens_per_s": round(output / device_s, 1),
            # llmb-admin stats' device_busy_fraction: summed batch run time / (wall time x live workers)
            "device_busy_fraction": round((c1["busy_s"] - c0["busy_s"]) / wall, 3),
            "device_busy_any_batch": rounded(busy_any, 3),
            "cost_per_million_tokens": round(price * device_hours / tokens * 1e6, 4) if tokens else None,
            "cost_per_million_output_tokens": round(price * device_hours / output * 1e6, 4) if output else None,
        },
    }
    if admin:
        scaled = dict(admin)
        if isinstance(admin.get("tokens_per_s"), (int, float)):
            scaled["tokens_per_s"] = round(admin["tokens_per_s"] / speed, 1)
        if isinstance(admin.get("cost_per_million_tokens"), (int, float)):
            scaled["cost_per_million_tokens"] = round(admin["cost_per_million_tokens"] * speed, 4)
        summary["llmb_admin_stats"] = {"raw": admin, "rescaled": {k: scaled.get(k) for k in (
            "tokens_per_s", "device_busy_fraction", "cost_per_million_tokens", "items_per_s", "live_workers")}}
    return summary
