"""Benchmark of issue 6: tenant fairness under a flood, overload at twice capacity, adaptive vs fixed wait.

    python -m bench.tenants [--out bench/results/tenants]    # ~6 minutes; writes report.json and summary.md

Each scenario starts its own system (gunicorn, batcher, sim worker) on the local RabbitMQ and Redis and drives
it with ``bench/load.py`` (open-loop Poisson arrivals, one gevent process per tenant).

- fairness: tenant B sends a steady 10 requests/s alone, then again while tenant A floods 5,000 requests
  (1,000/s for 5 s against a 400/s device); once with weighted fair batching and once with it effectively off
  (a quantum so large that whoever is at the head of the ring fills every batch: FIFO);
- overload: 200% of capacity for 20 s with a 4 s deadline: goodput, 429 latency, late answers;
- adaptive wait: light, medium and high load on two devices whose batch time grows with its size (20 or 5 ms
  per batch plus 2 ms per item), with the fixed 20 ms wait and with the adaptive one.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.stack import Stack

ROOT = Path(__file__).resolve().parent.parent

LOAD = [sys.executable, "-m", "bench.load"]  # run from ROOT (cwd=ROOT): it imports the harness


def start(out: Path, name: str, **env: object) -> Stack:
    stack = Stack(out / name, log_level="WARNING", **env)
    stack.start_worker(0)
    stack.start_batcher()
    stack.start_web()
    stack.wait_ready(workers=1)
    return stack


def load(stack: Stack, name: str, rate: float, duration: float, timeout_ms: int, **extra: object
         ) -> subprocess.Popen[bytes]:
    argv = [*LOAD, "--url", stack.url, "--rate", str(rate), "--duration", str(duration), "--timeout-ms",
            str(timeout_ms), "--out", str(stack.tmp / f"{name}.json")]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL)


def result(stack: Stack, name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    proc.wait(timeout=600)
    return json.loads((stack.tmp / f"{name}.json").read_text())


def fairness(out: Path, fair: bool) -> dict[str, Any]:
    label = "fair" if fair else "fifo"
    stack = start(out, f"fairness-{label}", sim_batch_ms=250, tenant_max_in_flight=10_000,
                  fair_quantum=10 if fair else 1_000_000)
    try:
        solo = result(stack, "b-solo", load(stack, "b-solo", 10, 8, 30_000, tenant="b", seed=1))["summary"]
        flood = load(stack, "a-flood", 1000, 5, 120_000, tenant="a", seed=2)
        time.sleep(1.0)
        steady = load(stack, "b-flooded", 10, 8, 30_000, tenant="b", seed=3)
        b = result(stack, "b-flooded", steady)["summary"]
        a = result(stack, "a-flood", flood)["summary"]
    finally:
        stack.close()
    row = {"b_solo": solo["latency_ms"], "b_with_flood": b["latency_ms"], "b_statuses": b["statuses"],
           "a_sent": a["sent"], "a_statuses": a["statuses"], "a_goodput_rps": a["goodput_rps"],
           "a_latency_ms": a["latency_ms"]}
    print(f"  fairness ({label}): B solo p50/p99 {solo['latency_ms']['p50']}/{solo['latency_ms']['p99']} ms; "
          f"with A's flood {b['latency_ms']['p50']}/{b['latency_ms']['p99']} ms; A {a['statuses']}, "
          f"goodput {a['goodput_rps']}/s", flush=True)
    return row


def overload(out: Path) -> dict[str, Any]:
    stack = start(out, "overload", sim_batch_ms=250)
    try:
        result(stack, "warm-up", load(stack, "warm-up", 200, 3, 4000, seed=4))
        s = result(stack, "overload-200", load(stack, "overload-200", 800, 20, 4000, seed=5))["summary"]
    finally:
        stack.close()
    print(f"  overload 200%: goodput {s['goodput_rps']}/s of 400; {s['statuses']}; p99 {s['latency_ms']['p99']} "
          f"ms; 429 p50/p99 {s['refused_latency_ms']}; late {s['late_over_100ms']}", flush=True)
    return s


DEVICES = {"20ms+2ms/item": (20, 2), "5ms+2ms/item": (5, 2)}  # fixed cost per batch + cost per item


def waits(out: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for device, (batch_ms, item_ms) in DEVICES.items():
        capacity = 100 / ((batch_ms + 100 * item_ms) / 1000)
        for mode in ("fixed", "adaptive"):
            stack = start(out, f"wait-{mode}-{batch_ms}", sim_batch_ms=batch_ms, sim_item_ms=item_ms,
                          wait_mode=mode)
            try:
                result(stack, "warm-up", load(stack, "warm-up", 50, 2, 4000, seed=6))
                for pct in (5, 25, 50, 90):
                    name = f"{device} {mode} {pct}%"
                    s = result(stack, f"{mode}-{pct}", load(stack, f"{mode}-{pct}", capacity * pct / 100, 15, 4000,
                                                            seed=7 + pct))["summary"]
                    rows[name] = s
                    print(f"  wait {name:<28}: p50 {s['latency_ms']['p50']} p99 {s['latency_ms']['p99']} ms, "
                          f"goodput {s['goodput_rps']}/s, mean batch {s['mean_batch_size_seen']}", flush=True)
            finally:
                stack.close()
    return rows


def summary(report: dict[str, Any]) -> str:
    lines = ["# Tenants and overload benchmark", "", f"Date: {report['date']}. One sim device per system.", "",
             "## Fairness: tenant B (10 req/s) alone, then during tenant A's flood of 5,000 requests", "",
             "| batching | B p50 alone | B p99 alone | B p50 in flood | B p99 in flood | B answers | A answers | "
             "A goodput/s |", "|---|---|---|---|---|---|---|---|"]
    for label, r in report["fairness"].items():
        lines.append(f"| {label} | {r['b_solo']['p50']} | {r['b_solo']['p99']} | {r['b_with_flood']['p50']} | "
                     f"{r['b_with_flood']['p99']} | {r['b_statuses']} | {r['a_statuses']} | {r['a_goodput_rps']} |")
    o = report["overload"]
    lines += ["", "## Overload: 800 req/s offered to a 400 req/s device for 20 s, deadline 4 s", "",
              f"Goodput {o['goodput_rps']}/s ({100 * o['goodput_rps'] / 400:.0f}% of capacity); answers "
              f"{o['statuses']}; p50/p99 of 200s {o['latency_ms']['p50']}/{o['latency_ms']['p99']} ms; 429 p50/p99 "
              f"{o['refused_latency_ms']['p50']}/{o['refused_latency_ms']['p99']} ms; answered >100 ms after the "
              f"deadline: {o['late_over_100ms']}.", "",
              "## Wait: fixed 20 ms vs adaptive, on devices whose batch time grows with its size", "",
              "| device (per batch + per item) | load | fixed p50 | adaptive p50 | fixed p99 | adaptive p99 "
              "| fixed goodput/s | adaptive goodput/s | fixed mean batch | adaptive mean batch |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    w = report["wait"]
    for device in DEVICES:
        for pct in (5, 25, 50, 90):
            f, a = w[f"{device} fixed {pct}%"], w[f"{device} adaptive {pct}%"]
            lines.append(f"| {device} | {pct}% | {f['latency_ms']['p50']} | {a['latency_ms']['p50']} | "
                         f"{f['latency_ms']['p99']} | {a['latency_ms']['p99']} | {f['goodput_rps']} | "
                         f"{a['goodput_rps']} | {f['mean_batch_size_seen']} | {a['mean_batch_size_seen']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tenants")
    ap.add_argument("--only", choices=["fairness", "overload", "wait"], nargs="*")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ["fairness", "overload", "wait"])
    path = args.out / "report.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    report["date"] = time.strftime("%Y-%m-%d")
    if "fairness" in only:
        report["fairness"] = {"weighted fair (DRR)": fairness(args.out, True), "FIFO": fairness(args.out, False)}
    if "overload" in only:
        report["overload"] = overload(args.out)
    if "wait" in only:
        report["wait"] = waits(args.out)
    path.write_text(json.dumps(report, indent=2))
    if {"fairness", "overload", "wait"} <= report.keys():
        (args.out / "summary.md").write_text(summary(report))
        print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
