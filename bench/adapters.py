"""LoRA adapters across a fleet: adapter-aware routing against adapter-blind routing and against base-only traffic.

    python -m bench.adapters                  # about 7 minutes on 2 cores; a Markdown table on stdout
    python -m bench.adapters --json report.json

The fleet: ``--workers`` sim-lm workers (continuous batching, Llama-2-7B on an A100 timing, a KV cache of
``--kv-tokens`` (24 of these calls at once, so that the device is the limit on this CPU and the batcher's load
figure means something), ``--slots`` batches at once, ``--max-adapters`` resident adapters each and
``--per-batch`` distinct adapters in a batch and in a step; the adapter costs of
:mod:`gpu_worker.backends.sim_lm_adapters`), one batcher. The
traffic: ``--adapters`` adapters (ranks 8, 16, 32, 64 in turn, each in a directory with its adapter_config.json)
with Zipf popularity (exponent ``--zipf``), adapter ``k`` owned by tenant ``k % --tenants``; each call a short
prompt of its tenant's and ``--max-tokens`` tokens to generate (EOS off: every answer is that long), streamed.
Arrivals are Poisson at each of ``--loads`` percent of the fleet's base-only capacity, the same trace (same
seed) for three runs: base-only (the same calls without their adapters), adapter-aware routing and adapter-blind
routing (``LLMB_ADAPTER_ROUTING=false``). Every run starts a fresh system, so every worker starts with no adapter.

Until adapters can be registered through the API (issue 44's registry part), the calls are made the way the API
will make them: through a gateway of this process's own (as ``llmb-admin replay`` does), the call's params naming
``adapter`` and ``adapter_path``. The capacity is measured first: ``--capacity-calls`` base-only calls at once,
completed calls over the time to the last answer. Before each run's trace, one call per adapter (all at once)
warms the fleet, as a fleet in service is warm: the figures are those of its steady state, not of cold loads.

Reported per run, in modelled time (wall time x ``--speed``): output tokens/s (and over base-only at the same
load), adapter loads per minute (after the warm-up), the affinity hit rate (calls that ran on a worker already
holding their adapter: its last heartbeat before their batch started listed it, or an earlier call of it started
there since, at least a load's time before), time to first token p50/p90, each worker's share of the
calls (max over mean) and each tenant's tokens served over asked (max over min: 1 is fair).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.run import machine
from harness.stack import Stack, running_stack
from harness.stats import percentile, rounded
from tasks.gateway.calls import Call, Delta, Done
from tasks.gateway.gateway import Gateway
from tasks.schema import SamplingParams

WORDS = ("policy", "travel", "expense", "hotel", "train", "flight", "receipt", "manager", "approve", "limit")
RANKS = (8, 16, 32, 64)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (k + 1) ** s for k in range(n)]


def trace(n: int, rate: float, adapters: int, zipf: float, seed: int) -> list[dict[str, Any]]:
    """``n`` calls at Poisson times (modelled seconds) at ``rate`` per second, each of an adapter drawn by Zipf."""
    rng = random.Random(seed)
    weights = zipf_weights(adapters, zipf)
    t, out = 0.0, []
    for i in range(n):
        adapter = rng.choices(range(adapters), weights)[0]
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
        out.append({"i": i, "t": t, "adapter": adapter, "question": f"question {i}: {question}?"})
        t += rng.expovariate(rate)
    return out


def adapter_dirs(root: Path, n: int) -> list[str]:
    dirs = []
    for k in range(n):
        path = root / f"lora{k}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps({"r": RANKS[k % len(RANKS)],
                                                              "target_modules": ["q_proj", "v_proj"]}))
        dirs.append(str(path))
    return dirs


def one_call(gateway: Gateway, c: dict[str, Any], args: argparse.Namespace, dirs: list[str] | None,
             t0: float) -> None:
    """One streamed call: ms to its first text and to its end, where and when its batch ran, its tokens."""
    adapter = f"lora{c['adapter']}" if dirs is not None else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=c["i"], adapter=adapter,
                            adapter_path=dirs[c["adapter"]] if dirs is not None else None)
    call = Call(request_id=uuid.uuid4().hex, tenant=f"tenant{c['adapter'] % args.tenants}", model="sim-lm",
                inputs=(c["question"],), timeout_ms=120_000, params=params)
    rec: dict[str, Any] = {"ok": False, "ttft_ms": None}
    started = time.monotonic()
    try:
        for event in gateway.stream(call):
            if isinstance(event, Delta) and rec["ttft_ms"] is None:
                rec["ttft_ms"] = (time.monotonic() - started) * 1000
            elif isinstance(event, Done):
                r = event.result
                out = r.output if isinstance(r.output, dict) else {}
                rec.update(ok=r.error is None, worker=r.worker, started_at=r.started_at,
                           tokens=int(out.get("completion_tokens") or 0), prompt=int(out.get("prompt_tokens") or 0))
            else:
                rec["error"] = str(event)
    except Exception as exc:  # a refusal: counted as not ok
        rec["error"] = str(exc)
    rec["done_s"] = time.monotonic() - t0
    c["rec"] = rec


def drive(gateway: Gateway, calls: list[dict[str, Any]], args: argparse.Namespace, dirs: list[str] | None,
          at_once: bool = False) -> float:
    """Offer the calls open loop (or all at once), a thread each; the wall seconds to the last answer."""
    threads = []
    t0 = time.monotonic()
    for c in calls:
        if not at_once:
            delay = t0 + c["t"] / args.speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        th = threading.Thread(target=one_call, args=(gateway, c, args, dirs, t0), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=300)
    return max((c["rec"]["done_s"] for c in calls if "rec" in c), default=time.monotonic() - t0)


class Beats:
    """Every heartbeat of the run: each worker's resident adapters over time (for the affinity hit rate)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.seen: dict[str, list[tuple[float, frozenset[str]]]] = defaultdict(list)
        self.last: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            try:
                fleet = self.stack.fleet()
            except Exception:
                continue
            for wid, b in fleet.items():
                at = float(b["heartbeat_at"])
                if not self.seen[wid] or self.seen[wid][-1][0] < at:
                    self.seen[wid].append((at, frozenset(b.get("adapters") or ())))
                self.last[wid] = b

    def resident(self, worker: str, at: float) -> frozenset[str]:
        """What ``worker``'s last heartbeat before ``at`` listed as resident."""
        held: frozenset[str] = frozenset()
        for when, names in self.seen.get(worker, []):
            if when > at:
                break
            held = names
        return held

    def reported_at(self, worker: str, at: float) -> float:
        """When ``worker``'s last heartbeat before ``at`` was taken (-inf: none)."""
        last = float("-inf")
        for when, _ in self.seen.get(worker, []):
            if when > at:
                break
            last = when
        return last

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


LOAD_S = 0.03  # a load takes at most this long (modelled: 5 ms + a rank-64 q/v adapter's 67 MB over 25 GB/s)


def held(beats: Beats, earlier: dict[tuple[str, int], list[float]], worker: str, adapter: int, at: float,
         load_s: float) -> bool:
    """Whether ``worker`` held ``adapter`` when a batch started there at ``at``: its last heartbeat before listed
    it, or an earlier call of it started there since that heartbeat, at least a load's time before."""
    if f"lora{adapter}" in beats.resident(worker, at):
        return True
    since = beats.reported_at(worker, at)
    return any(since <= t <= at - load_s for t in earlier.get((worker, adapter), ()))


def fleet_stack(tmp: Path, args: argparse.Namespace, routing: bool) -> Any:
    workers = [(d, {"backend": "sim-lm", "sim_lm_speed": args.speed, "sim_lm_slots": args.slots,
                    "sim_lm_adapter_load_ms": args.load_ms})
               for d in range(args.workers)]
    return running_stack(tmp, workers=workers, web_workers=1, adapter_routing=routing, sim_lm_eos_mean=0,
                         sim_lm_max_seqs=args.max_seqs, sim_lm_kv_tokens=args.kv_tokens, max_adapters=args.max_adapters,
                         max_adapters_per_batch=args.per_batch, max_outstanding_batches=args.outstanding,
                         prefix_wait_ms=args.wait_ms,
                         heartbeat_interval_s=0.1, heartbeat_stale_factor=20,
                         max_tokens_cap=max(256, args.max_tokens), log_level="WARNING")


def run(args: argparse.Namespace, mode: str, calls: list[dict[str, Any]], at_once: bool = False) -> dict[str, Any]:
    """One fresh system serving ``calls``: ``mode`` base-only, adapter-aware or adapter-blind."""
    from tasks.cli.main import Admin
    from tasks.config import Settings

    calls = [dict(c) for c in calls]
    with tempfile.TemporaryDirectory(prefix="llmb-adapters-") as tmp, \
            fleet_stack(Path(tmp), args, routing=mode != "adapter-blind") as stack:
        dirs = None if mode == "base-only" else adapter_dirs(Path(tmp) / "adapters", args.adapters)
        gateway = Admin(Settings.from_env(stack.env)).gateway()
        gateway.live_workers(fresh=True)
        beats = Beats(stack)
        try:
            if not at_once:  # one call per adapter first: the run measures a fleet in its steady state
                warm = [{"i": -1 - k, "t": 0.0, "adapter": k, "question": "warm-up?"} for k in range(args.adapters)]
                drive(gateway, warm, args, dirs, at_once=True)
                time.sleep(0.3)  # a heartbeat after it
            warm_loads = sum(int(b.get("adapter_loads") or 0) for b in beats.last.values())
            warm_evictions = sum(int(b.get("adapter_evictions") or 0) for b in beats.last.values())
            wall = drive(gateway, calls, args, dirs, at_once)
            time.sleep(0.3)  # a heartbeat after the last answer
        finally:
            beats.stop()
    speed, minutes = args.speed, wall * args.speed / 60
    ok = [c for c in calls if c["rec"]["ok"]]
    ttft = [c["rec"]["ttft_ms"] * speed for c in ok if c["rec"]["ttft_ms"] is not None]
    output = sum(c["rec"]["tokens"] for c in ok)
    by_worker: dict[str, int] = defaultdict(int)
    asked: dict[str, int] = defaultdict(int)
    served: dict[str, int] = defaultdict(int)
    hits = 0
    earlier: dict[tuple[str, int], list[float]] = defaultdict(list)  # (worker, adapter) -> batch starts
    for c in sorted(ok, key=lambda c: c["rec"]["started_at"]):
        earlier[(c["rec"]["worker"], c["adapter"])].append(c["rec"]["started_at"])
    for c in calls:
        asked[f"tenant{c['adapter'] % args.tenants}"] += args.max_tokens
    for c in ok:
        rec = c["rec"]
        by_worker[rec["worker"]] += 1
        served[f"tenant{c['adapter'] % args.tenants}"] += rec["tokens"]
        hits += held(beats, earlier, rec["worker"], c["adapter"], rec["started_at"], LOAD_S / speed)
    loads = sum(int(b.get("adapter_loads") or 0) for b in beats.last.values()) - warm_loads
    evictions = sum(int(b.get("adapter_evictions") or 0) for b in beats.last.values()) - warm_evictions
    share = {t: served[t] / n for t, n in asked.items() if n}
    mean_worker = len(ok) / max(1, args.workers)
    return {
        "mode": mode, "calls": len(calls), "ok": len(ok), "wall_s": round(wall, 1),
        "calls_per_s": round(len(ok) / (wall * speed), 2), "output_tokens_per_s": round(output / (wall * speed), 1),
        "ttft_ms": {f"p{p}": rounded(percentile(ttft, p), 0) for p in (50, 90, 99)},
        "adapter_loads": loads, "adapter_evictions": evictions,
        "loads_per_min": round(loads / minutes, 1) if minutes and mode != "base-only" else None,
        "affinity_hit_rate": round(hits / len(ok), 3) if ok and mode != "base-only" else None,
        "worker_calls": dict(by_worker),
        "worker_max_over_mean": round(max(by_worker.values()) / mean_worker, 2) if by_worker else None,
        "tenant_served_over_asked_max_over_min": round(max(share.values()) / min(share.values()), 3)
        if share and min(share.values()) > 0 else None,
    }


def fmt(value: object) -> object:
    return "-" if value is None else value


def markdown(report: dict[str, Any]) -> str:
    lines = ["| load | routing | calls ok | output tok/s | x base-only | loads/min | affinity | TTFT p50 | TTFT p90 "
             "| worker max/mean | tenant max/min |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for load, runs in report["runs"].items():
        base = runs["base-only"]["output_tokens_per_s"] if "base-only" in runs else None
        for mode, r in runs.items():
            ratio = f"{r['output_tokens_per_s'] / base:.2f}" if base else "-"
            lines.append(f"| {load}% | {mode} | {r['ok']}/{r['calls']} | {r['output_tokens_per_s']} | {ratio} | "
                         f"{fmt(r['loads_per_min'])} | {fmt(r['affinity_hit_rate'])} | {fmt(r['ttft_ms']['p50'])} | "
                         f"{fmt(r['ttft_ms']['p90'])} | {fmt(r['worker_max_over_mean'])} | "
                         f"{fmt(r['tenant_served_over_asked_max_over_min'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--loads", default="50,80,100", help="percent of the base-only capacity")
    p.add_argument("--duration", type=float, default=20.0, help="modelled seconds of arrivals per run")
    p.add_argument("--speed", type=float, default=1.0, help="sim-lm speed-up (LLMB_SIM_LM_SPEED)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-seqs", type=int, default=64, help="sequences a worker steps at once")
    p.add_argument("--kv-tokens", type=int, default=3072, help="a worker's KV cache (3072: 24 calls at once)")
    p.add_argument("--max-adapters", type=int, default=32, help="LLMB_MAX_ADAPTERS")
    p.add_argument("--per-batch", type=int, default=16, help="LLMB_MAX_ADAPTERS_PER_BATCH")
    p.add_argument("--outstanding", type=int, default=2, help="LLMB_MAX_OUTSTANDING_BATCHES")
    p.add_argument("--slots", type=int, default=16, help="LLMB_SIM_LM_SLOTS: batches a worker runs at once")
    p.add_argument("--load-ms", type=float, default=5.0, help="LLMB_SIM_LM_ADAPTER_LOAD_MS: a load's fixed part")
    p.add_argument("--wait-ms", type=float, default=1000.0, help="LLMB_PREFIX_WAIT_MS: the wait for a busy holder")
    p.add_argument("--capacity-calls", type=int, default=0, help="0: 6 x workers x kv-tokens / 128")
    p.add_argument("--capacity", type=float, default=0.0, help="calls/s to take as the capacity (0: measure it)")
    p.add_argument("--modes", default="base-only,adapter-aware,adapter-blind")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    loads = [int(x) for x in args.loads.split(",")]
    n = args.capacity_calls or 6 * args.workers * args.kv_tokens // 128
    burst = trace(n, 1.0, args.adapters, args.zipf, args.seed + 1)
    capacity = args.capacity or run(args, "base-only", burst, at_once=True)["calls_per_s"]
    report: dict[str, Any] = {"date": dt.date.today().isoformat(), "machine": machine(), "args": vars(args),
                              "capacity_calls_per_s": capacity, "runs": {}}
    for load in loads:
        rate = capacity * load / 100
        calls = trace(max(1, int(rate * args.duration)), rate, args.adapters, args.zipf, args.seed)
        report["runs"][load] = {mode: run(args, mode, calls) for mode in args.modes.split(",")}
        print(json.dumps({load: {m: {k: r[k] for k in ("ok", "output_tokens_per_s", "affinity_hit_rate",
                                                       "loads_per_min", "ttft_ms", "worker_max_over_mean")}
                                 for m, r in report["runs"][load].items()}}), flush=True)
    print(f"capacity (base-only, measured): {capacity} calls/s")
    print(markdown(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
