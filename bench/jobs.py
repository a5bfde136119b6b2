"""Benchmark of the Batch API: how fast a job runs on an idle device, and what a running job costs interactive
callers.

    python -m bench.jobs [--lines 1000] [--batch-ms 250] [--rate 100] [--duration 15] [--out bench/results/jobs]

One system (gunicorn, batcher, one sim worker: ``--batch-ms`` per batch of up to 100, so a capacity of
100 / batch time items/s, and ``llmb-jobs``) on the local RabbitMQ and Redis, without API keys:

1. a job of ``--lines`` ``/v1/infer`` lines alone: lines/s from ``in_progress`` to ``finalizing`` (the server's
   clock), against the device's capacity;
2. interactive callers alone: open-loop Poisson arrivals (``bench/load.py``) at ``--rate`` for ``--duration`` s:
   latency p50/p99;
3. the same callers while a job big enough to outlast them runs: their latency again, and the job's lines/s
   meanwhile (the room the callers leave: capacity - rate);
4. the same callers while a job runs on a second device (a sim worker of another model): what the job costs them
   through the shared CPU, brokers and batcher alone, without sharing their device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.stack import Stack, wait_for

ROOT = Path(__file__).resolve().parent.parent

LOAD = [sys.executable, "-m", "bench.load"]  # run from ROOT (cwd=ROOT): it imports the harness


def jsonl(n: int, tag: str, model: str = "sim") -> bytes:
    return "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/infer",
                               "body": {"input": f"{tag} line {i}", "model": model}}) + "\n"
                   for i in range(n)).encode()


def job_times(stack: Stack, batch_id: str) -> dict[str, Any]:
    return json.loads(stack.admin("jobs", "show", batch_id, "--json").stdout)


def interactive(stack: Stack, name: str, rate: float, duration: float) -> dict[str, Any]:
    out = stack.tmp / f"{name}.json"
    subprocess.run([*LOAD, "--url", stack.url, "--rate", str(rate), "--duration", str(duration), "--timeout-ms",
                    "10000", "--tenant", "web", "--seed", "7", "--out", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, timeout=duration + 120)
    return json.loads(out.read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--batch-ms", type=float, default=250.0)
    ap.add_argument("--rate", type=float, default=100.0, help="interactive requests/s")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of interactive arrivals")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "jobs"))
    args = ap.parse_args()
    import openai

    out = Path(args.out)
    capacity = 100 / (args.batch_ms / 1000)
    stack = Stack(out / "stack", log_level="WARNING", sim_batch_ms=args.batch_ms, files_dir=out / "stack" / "files",
                  jobs_poll_s=0.2)
    report: dict[str, Any] = {"capacity_items_per_s": capacity, "batch_ms": args.batch_ms, "lines": args.lines,
                              "interactive_rps": args.rate, "duration_s": args.duration, "cpus": os.cpu_count(),
                              "load_before": os.getloadavg()[0]}
    try:
        stack.start_worker(0)
        stack.start_worker(1, model="other")  # scenario 4's device
        stack.start_batcher()
        stack.start_web()
        stack.start_jobs()
        stack.wait_ready(workers=2)
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                               default_headers={"X-Tenant": "batch"})

        def run_job(n: int, tag: str, model: str = "sim") -> str:
            f = client.files.create(file=(f"{tag}.jsonl", jsonl(n, tag, model)), purpose="batch")
            return client.batches.create(input_file_id=f.id, endpoint="/v1/infer",  # type: ignore[arg-type]
                                         completion_window="24h").id

        def completed(batch_id: str) -> int:
            """Lines of the job answered so far (the server reports a job's counts from its creation on)."""
            counts = client.batches.retrieve(batch_id).request_counts
            assert counts is not None, f"{batch_id} has no request counts"
            return counts.completed

        # 1. a job alone
        started = time.monotonic()
        alone = run_job(args.lines, "alone")
        wait_for(lambda: client.batches.retrieve(alone).status == "completed", 600, "the job alone")
        wall = time.monotonic() - started
        t = job_times(stack, alone)
        run_s = t["finalizing_at"] - t["in_progress_at"]
        report["alone"] = {"wall_s": round(wall, 2), "run_s": round(run_s, 2),
                           "lines_per_s": round(args.lines / run_s, 1),
                           "fraction_of_capacity": round(args.lines / run_s / capacity, 3)}
        print(f"job of {args.lines} lines alone: {report['alone']['lines_per_s']} lines/s "
              f"({report['alone']['fraction_of_capacity']:.0%} of the device's {capacity:.0f} items/s); "
              f"{wall:.1f} s from create to completed", flush=True)

        # 2. interactive callers alone
        base = interactive(stack, "interactive-alone", args.rate, args.duration)
        report["interactive_alone"] = base
        print(f"interactive alone at {args.rate:g}/s: p50 {base['latency_ms']['p50']} ms, p99 "
              f"{base['latency_ms']['p99']} ms, {base['statuses']}", flush=True)

        # 3. the same callers beside a job that outlasts them, on their device; 4. on another device
        for name, model in (("with_job", "sim"), ("with_job_elsewhere", "other")):
            big = int((capacity - args.rate) * (args.duration + 20) * 1.5)
            during = run_job(big, name, model)
            wait_for(lambda b=during: completed(b) >= 500, 120,
                     "the job under way")
            before = completed(during)
            t0 = time.monotonic()
            loaded = interactive(stack, f"interactive-{name}", args.rate, args.duration)
            elapsed = time.monotonic() - t0
            job_rate = (completed(during) - before) / elapsed
            report[f"interactive_{name}"] = loaded
            report[f"job_during_load_{name}"] = {"lines": big, "lines_per_s": round(job_rate, 1)}
            where = "on their device" if model == "sim" else "on another device"
            print(f"interactive with a job running {where}: p50 {loaded['latency_ms']['p50']} ms, p99 "
                  f"{loaded['latency_ms']['p99']} ms, {loaded['statuses']}; the job meanwhile {job_rate:.0f} "
                  f"lines/s", flush=True)
            client.batches.cancel(during)
            wait_for(lambda b=during: client.batches.retrieve(b).status == "cancelled", 120, "the big job cancelled")
        shared = report["interactive_with_job"]["goodput_rps"] + report["job_during_load_with_job"]["lines_per_s"]
        report["device_use_with_job"] = round(shared / capacity, 3)
        print(f"their device meanwhile: {shared:.0f} items/s of {capacity:.0f} ({shared / capacity:.0%})", flush=True)
    finally:
        stack.close()
    report["load_after"] = os.getloadavg()[0]  # the 1-minute load average: other work on the host skews the figures
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
