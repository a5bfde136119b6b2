"""Cables pulled under load, the system spread over hosts (network namespaces, harness/netns/): outcome counts.

    sudo .venv/bin/python -m bench.hosts                     # every scenario, ~2 minutes
    sudo .venv/bin/python -m bench.hosts --only gpu batcher  # some of them
    sudo .venv/bin/python -m bench.hosts --json out.json --keep-logs

Needs root and ``ip netns``. Brings up svc (a private RabbitMQ node and Redis), api, api2, batcher1, batcher2,
gpu1, gpu2 (sim, 300 ms per batch) and a client host on a bridge, then runs each scenario on the same hosts
(made whole again in between) and prints, per scenario: sent, answers by status, connection errors, wrong
outputs, answered twice, late (after deadline + 1 s), the longest wait past the deadline, p50/p99, and the
scenario's own timings. The shipped defaults otherwise (heartbeats 1 s, AMQP heartbeat 2 s, API lease 5 s).

Scenarios: ``gpu`` (gpu1's cable pulled mid-batch, restored), ``batcher`` (the active batcher's cable pulled,
restored), ``api`` (the only API host's cable pulled with callers in flight, restored), ``api-beside`` (the same
while api2 serves too), ``fairness`` (a steady tenant beside another's flood, with one and with two batchers,
and the most batches outstanding per worker).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from harness.loadgen import LoadReport
from harness.netns.hosts import Hosts, unavailable
from harness.netns.scenarios import api_cut, batcher_cut, fairness, gpu_cut, outcome_counts

SCENARIOS = ("gpu", "batcher", "api", "api-beside", "fairness")
HOSTS = ("api", "api2", "batcher1", "batcher2", "gpu1", "gpu2")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def row(name: str, report: LoadReport, timeout_ms: int, **facts: Any) -> dict[str, Any]:
    return {"scenario": name, **outcome_counts(report, timeout_ms), **facts}


def run(h: Hosts, scenario: str) -> list[dict[str, Any]]:
    h.whole()
    if scenario == "gpu":
        g = gpu_cut(h)
        return [row("gpu host cut", g.report, g.timeout_ms, left_pool=_s(g.left_pool_s), rejoined=_s(g.rejoined_s),
                    ran_again=_s(g.ran_again_s), skipped_on_waking=g.skipped_late, max_outstanding=g.outstanding)]
    if scenario == "batcher":
        b = batcher_cut(h)
        return [row("active batcher host cut", b.report, b.timeout_ms, amqp_heartbeat=b.heartbeat_s,
                    standby_took_over=_s(b.switched_s), first_answer_after_cut=_s(b.first_answer_s),
                    worst_latency_sent_in_first_s=f"{b.worst_after_cut_ms:.0f} ms", rejoined=_s(b.rejoined_s),
                    max_outstanding=b.outstanding)]
    if scenario in ("api", "api-beside"):
        beside = "api2" if scenario == "api-beside" else None
        if beside is None:
            h.signal("api2")
        a = api_cut(h, "api", beside=beside)
        rows = [row("API host cut" + (" beside api2" if beside else " (the only one)"), a.report, a.timeout_ms,
                    held_at_cut=a.held_at_cut, released=_s(a.released_s), still_held=a.still_held,
                    resumed=_s(a.resumed_s), left_admitted_after=a.inflight_after)]
        if a.other is not None:
            rows.append(row("  callers of api2 meanwhile", a.other, 10_000))
        return rows
    if scenario == "fairness":
        from harness.stack import wait_for

        standby = next(b for b in h.batcher_hosts if b != h.active_batcher())
        h.signal(standby)
        wait_for(lambda: h.queue(h.request_queue)[1] == 1, 30, "one batcher consuming")
        one = fairness(h)
        h.start(standby)
        wait_for(lambda: h.queue(h.request_queue)[1] == 2, 30, "two batchers consuming")
        two = fairness(h)
        rows = []
        for f in (one, two):
            rows.append(row(f"steady tenant beside a flood, {f.batchers} batcher(s)", f.steady, 10_000,
                            flood_items=f.flood_items, flood_drained=_s(f.flood_s), max_outstanding=f.outstanding))
            rows.append(row("  the flood's calls", f.flood, 15_000))
        return rows
    raise ValueError(scenario)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (path printed)")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        sys.exit(f"bench.hosts: {reason}")
    logs = Path(f"/tmp/llmb-bench-hosts-{int(time.time())}") if args.keep_logs else None
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with Hosts(HOSTS, logs=logs, sim_batch_ms=300, log_level="INFO") as h:
        print(f"hosts up: RabbitMQ {h.timings.rabbitmq_s:.1f} s, processes {h.timings.processes_s:.1f} s", flush=True)
        for scenario in args.only:
            for r in run(h, scenario):
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n{len(rows)} rows in {time.monotonic() - started:.0f} s" + (f"; logs in {logs}" if logs else ""))
    cols = ["scenario", "sent", "200", "429", "503", "504", "conn_errors", "wrong_output", "answered_twice", "late",
            "max_past_deadline_ms", "p50_ms", "p99_ms"]
    print("\n| " + " | ".join(cols) + " | details |\n|" + "---|" * (len(cols) + 1))
    for r in rows:
        details = ", ".join(f"{k} {v}" for k, v in r.items() if k not in cols and k != "other" and v not in ({}, None))
        cells = [str(r[c]) if not isinstance(r[c], dict) else (" ".join(f"{k}:{v}" for k, v in r[c].items()) or "0")
                 for c in cols]
        print("| " + " | ".join(cells) + f" | {details} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
