"""The benchmark: the real system (and the in-process reference) under open-loop load, with a report.

    python -m bench.run                      # full run, a few minutes; report in bench/results/latest/
    python -m bench.run --smoke --no-plots   # seconds: what CI runs to keep it working

Starts its own system on the local RabbitMQ and Redis (gunicorn, batcher, sim workers, in a namespace of its
own), runs each scenario with ``bench/load.py``, samples the CPU time of every process of the system
(web, batcher, workers, RabbitMQ, Redis), and writes ``report.json``, ``summary.md`` and PNG plots.
Capacity = workers x max batch / batch time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict

from harness import refusal_times
from harness.helpers import decoded
from harness.stack import Stack, free_port, wait_for
from harness.stats import percentile

ROOT = Path(__file__).resolve().parent.parent

PYTHON = sys.executable
LOAD = [PYTHON, "-m", "bench.load"]  # run from ROOT (cwd=ROOT): it imports the harness
POISON = "__bench_poison__"


# -- measuring ------------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, float] | None:
    """(process group, CPU seconds) of a process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[2]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SERVICES = {"beam.smp": "rabbitmq", "redis-server": "redis"}


def cpu_by_process(groups: dict[int, str], services: bool = True) -> dict[str, float]:
    """CPU seconds used so far, by role: every process of each group in ``groups`` (process group -> role,
    e.g. the gunicorn master and its workers are "web"), plus RabbitMQ and Redis."""
    totals: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is None:
            continue
        pgrp, seconds = stat
        role = groups.get(pgrp)
        if role is None and services:
            try:
                role = SERVICES.get((entry / "comm").read_text().strip())
            except OSError:
                continue
        if role is not None:
            totals[role] = totals.get(role, 0.0) + seconds
    return totals


def cpu_seconds(groups: dict[int, str]) -> float:
    return sum(cpu_by_process(groups).values())  # the system's processes and the services it uses


class BatchMetrics(TypedDict):
    batches: float
    items: float
    busy_s: float
    buckets: dict[str, float]  # batch size bucket -> batches


def batch_metrics(stack: Stack) -> BatchMetrics:
    """Batches run, items in them and device seconds, from the workers' Redis histograms."""
    sizes = {decoded(k): float(v) for k, v in stack.redis.hgetall(f"{stack.namespace}:metrics:batch_size").items()}
    runs = {decoded(k): float(v) for k, v in
            stack.redis.hgetall(f"{stack.namespace}:metrics:batch_run_seconds").items()}
    return {"batches": sum(v for k, v in sizes.items() if k != "sum"), "items": sizes.get("sum", 0.0),
            "busy_s": runs.get("sum", 0.0), "buckets": {k: v for k, v in sizes.items() if k != "sum"}}


def load(url: str, rate: float, duration: float, timeout_ms: int, out: Path, **extra: Any) -> dict[str, Any]:
    argv = [*LOAD, "--url", url, "--rate", str(rate), "--duration", str(duration), "--timeout-ms",
            str(timeout_ms), "--out", str(out)]
    for key, value in extra.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=duration + timeout_ms / 1000 + 120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result: dict[str, Any] = json.loads(out.read_text())
    summary = result["summary"]  # the generator's own CPU: taken from the same cores as the system's, not counted in it
    summary["generator_cpu_ms_per_request"] = round(
        (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000 / max(summary["sent"], 1), 3)
    return result


# -- the system and the reference ----------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.capacity = args.workers * args.max_batch / (args.batch_ms / 1000)
        self.results: dict[str, Any] = {}

    def start_system(self) -> Stack:
        a = self.args
        stack = Stack(self.out / "system", sim_batch_ms=a.batch_ms, max_batch_size=a.max_batch,
                      max_wait_ms=a.max_wait_ms, wait_mode=a.wait_mode, sim_raise_on=POISON,
                      log_level="WARNING")
        for n in range(a.workers):
            stack.start_worker(n)
        stack.start_batcher()
        stack.start_web(workers=a.web_workers)
        stack.wait_ready(workers=a.workers)
        return stack

    def measure(self, name: str, url: str, pct: float, groups: dict[int, str], stack: Stack | None = None,
                **extra: Any) -> dict[str, Any]:
        a = self.args
        rate = self.capacity * pct / 100
        services = stack is not None  # the reference uses neither RabbitMQ nor Redis
        cpu0, m0, t0 = cpu_by_process(groups, services), batch_metrics(stack) if stack else None, time.monotonic()
        timed = refusal_times.scrape(url) if stack else None
        result = load(url, rate, a.duration, a.timeout_ms, self.out / f"{name}.requests.json",
                      client_timeout_ms=a.client_timeout_ms, keep_alive=a.keep_alive, **extra)
        wall, cpu1 = time.monotonic() - t0, cpu_by_process(groups, services)
        summary = result["summary"]
        sent = max(summary["sent"], 1)
        split = {role: round((cpu1[role] - cpu0.get(role, 0.0)) * 1000 / sent, 3) for role in cpu1}
        summary.update(name=name, offered_pct=pct, wall_s=round(wall, 2),
                       cpu_ms_per_request=round(sum(split.values()), 3), cpu_ms_per_request_by_process=split)
        if timed is not None:  # the service's own timing of its 429s, from their arrival
            summary["server_429"] = refusal_times.refusals_since(timed, refusal_times.scrape(url))
        if stack is not None and m0 is not None:
            m1 = batch_metrics(stack)
            batches, items = m1["batches"] - m0["batches"], m1["items"] - m0["items"]
            summary["batches"] = int(batches)
            summary["batch_fill"] = round(items / (batches * a.max_batch), 3) if batches else None
            summary["device_idle_fraction"] = round(1 - (m1["busy_s"] - m0["busy_s"]) / (wall * a.workers), 3)
            summary["batch_size_buckets"] = {k: m1["buckets"].get(k, 0) - m0["buckets"].get(k, 0)
                                             for k in m1["buckets"]}
        print(f"  {name:<24} offered {rate:7.1f}/s  goodput {summary['goodput_rps']:7.1f}/s  "
              f"p50 {summary['latency_ms']['p50']}  p99 {summary['latency_ms']['p99']}  "
              f"statuses {summary['statuses']}  cpu {summary['cpu_ms_per_request']} ms/req", flush=True)
        self.results[name] = summary
        return summary

    def lone(self, name: str, url: str) -> None:
        """Requests one at a time on an idle system: p50 - batch time - max wait is pure plumbing overhead."""
        import requests

        a, times = self.args, []
        for i in range(a.lone_requests):
            time.sleep(a.batch_ms / 1000 * 1.5)  # let the previous batch finish: the device is idle
            started = time.monotonic()
            r = requests.post(url + "/v1/infer", json={"input": f"lone {i}", "timeout_ms": a.timeout_ms}, timeout=30)
            r.raise_for_status()
            times.append((time.monotonic() - started) * 1000)
        p50 = percentile(times, 50) or 0.0  # 0 for no requests asked for
        self.results[name] = {"name": name, "requests": len(times), "p50_ms": round(p50, 2),
                              "overhead_ms": round(p50 - a.batch_ms - a.max_wait_ms, 2)}
        print(f"  {name:<24} p50 {p50:.1f} ms; overhead {p50 - a.batch_ms - a.max_wait_ms:.1f} ms", flush=True)

    def run_system(self) -> None:
        a = self.args
        stack = self.start_system()
        try:
            groups = {p.pid: _role(n) for n, p in stack.procs.items()}
            self.lone("system-lone", stack.url)
            self.measure("warm-up", stack.url, 20, groups, stack)
            for pct in a.loads:
                self.measure(f"system-{pct:g}%", stack.url, pct, groups, stack)
            if a.smoke:
                return
            self.measure("poison-1-in-1000", stack.url, 50, groups, stack, poison_every=1000,
                         poison_marker=POISON)
            if a.workers > 1:
                self.fault(stack)
        finally:
            stack.close()

    def fault(self, stack: Stack) -> None:
        """SIGKILL one worker in the middle of a run at 60% of capacity."""
        a = self.args
        out = self.out / "fault.requests.json"
        argv = [*LOAD, "--url", stack.url, "--rate", str(self.capacity * 0.6), "--duration", str(a.duration),
                "--timeout-ms", str(a.timeout_ms), "--out", str(out)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL)
        time.sleep(a.duration / 2)
        killed_at = a.duration / 2
        stack.kill("gpu0", sig=signal.SIGKILL)
        proc.wait(timeout=a.duration + 120)
        result = json.loads(out.read_text())["summary"]
        result.update(name="fault-sigkill-worker", offered_pct=60, killed_at_s=killed_at)
        self.results["fault-sigkill-worker"] = result
        print(f"  fault-sigkill-worker     statuses {result['statuses']}  p99 {result['latency_ms']['p99']}")

    def run_reference(self) -> None:
        a = self.args
        port = free_port()
        proc = subprocess.Popen([PYTHON, str(ROOT / "bench" / "reference.py"), "--port", str(port), "--devices",
                                 str(a.workers), "--batch-ms", str(a.batch_ms), "--max-batch-size",
                                 str(a.max_batch), "--max-wait-ms", str(a.max_wait_ms)], start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _port_open(port), 20, "the reference server")
            self.lone("reference-lone", url)
            for pct in a.ref_loads:
                self.measure(f"reference-{pct:g}%", url, pct, {proc.pid: "reference"})
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)


def _role(process_name: str) -> str:
    """web, batcher or worker, from a stack's process name (web, batcher, gpu0, ...)."""
    return "worker" if process_name.startswith("gpu") else process_name


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# -- the report -----------------------------------------------------------------------------------------
def targets(bench: Bench) -> list[tuple[str, str, str, bool | None]]:
    """(target, limit, measured, met) for each target of the benchmark (issue 12's, on the headline scenario)."""
    r = bench.results
    rows: list[tuple[str, str, str, bool | None]] = []
    if (lone := r.get("system-lone")) and (ref_lone := r.get("reference-lone")):
        extra = lone["overhead_ms"] - ref_lone["overhead_ms"]
        rows.append(("light-load overhead (p50 − batch − wait) over the reference's", "≤ 10 ms",
                     f"{extra:.1f} ms ({lone['overhead_ms']:.1f} vs {ref_lone['overhead_ms']:.1f})", extra <= 10))
    for pct, q, limit in ((10, "p50", 10), (90, "p99", 100)):
        mine, ref = r.get(f"system-{pct}%"), r.get(f"reference-{pct}%")
        if mine and ref and mine["latency_ms"][q] is not None and ref["latency_ms"][q] is not None:
            extra = mine["latency_ms"][q] - ref["latency_ms"][q]
            rows.append((f"{pct}% load: {q} over the reference's", f"≤ {limit} ms",
                         f"{extra:.0f} ms ({mine['latency_ms'][q]:.0f} vs {ref['latency_ms'][q]:.0f})", extra <= limit))
    if (s90 := r.get("system-90%")) is not None:
        rows.append(("90% load: answered 200", "≥ 99%", f"{100 * (s90['ok_fraction'] or 0):.2f}%",
                     (s90["ok_fraction"] or 0) >= 0.99))
        rows.append(("CPU per request, all processes (90% load)", "≤ 1.0 ms", f"{s90['cpu_ms_per_request']} ms",
                     s90["cpu_ms_per_request"] <= 1.0))
    for pct in (150, 300):
        if (s := r.get(f"system-{pct}%")) is None:
            continue
        share = s["goodput_rps"] / bench.capacity
        rows.append((f"{pct}% load: goodput (200 within the client's deadline)", "≥ 95% of capacity",
                     f"{100 * share:.1f}%", share >= 0.95))
        admitted = s["statuses"].get("200", 0) + s["statuses"].get("504", 0) + s["statuses"].get("client_timeout", 0)
        late = s["statuses"].get("client_timeout", 0)
        share_late = late / admitted if admitted else 0.0
        rows.append((f"{pct}% load: answers reaching the client after its deadline", "≤ 0.1%",
                     f"{100 * share_late:.2f}% ({late})", share_late <= 0.001))
        p99_429 = s["refused_latency_ms"]["p99"]
        rows.append((f"{pct}% load: 429 latency p99", "≤ 20 ms", f"{p99_429} ms" if p99_429 else "no 429",
                     None if p99_429 is None else p99_429 <= 20))
        if (within := (s.get("server_429") or {}).get("within_20ms")) is not None:
            rows.append((f"{pct}% load: 429s answered within 20 ms of arrival, as the service timed them", "≥ 99%",
                         f"{100 * within:.1f}%", within >= 0.99))
    late = sum(v.get("late_over_100ms", 0) for k, v in r.items() if k.startswith(("system", "poison", "fault")))
    rows.append(("callers answered > 100 ms after their deadline", "0", str(late), late == 0))
    return rows


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    system = f"{platform.system()} {platform.release()}"
    return f"{os.cpu_count()} cores ({model}), {system}, Python {platform.python_version()}"


def write_report(bench: Bench, plots: bool) -> None:
    a, out = bench.args, bench.out
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
              "config": {k: v for k, v in vars(a).items() if k != "out"}, "capacity_rps": bench.capacity,
              "scenarios": bench.results,
              "targets": [{"target": t, "limit": lim, "measured": m, "met": ok} for t, lim, m, ok in targets(bench)]}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Benchmark, {report['date'][:10]}", "",
             f"Machine: {report['machine']}. System: {a.workers} sim worker(s), {a.batch_ms:g} ms per batch of up "
             f"to {a.max_batch}, max wait {a.max_wait_ms:g} ms, {a.web_workers} gunicorn process(es); capacity "
             f"**{bench.capacity:g} requests/s**. Each point: {a.duration:g} s of Poisson arrivals, deadline "
             f"{a.timeout_ms} ms. The load generator runs on the same machine, "
             f"{'reusing connections (--keep-alive)' if a.keep_alive else 'one new connection per request'}.", "",
             "| scenario | offered/s | goodput/s | 200 | other answers | p50 ms | p90 ms | p99 ms | 429 p99 ms "
             "| batch fill | device idle | CPU ms/req |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in bench.results.items():
        if name == "warm-up" or "lone" in name:
            continue
        others = ", ".join(f"{k}: {v}" for k, v in s["statuses"].items() if k != "200") or "-"
        fill = f"{100 * s['batch_fill']:.0f}%" if s.get("batch_fill") is not None else "-"
        idle = f"{100 * s['device_idle_fraction']:.0f}%" if s.get("device_idle_fraction") is not None else "-"
        lines.append(f"| {name} | {s['offered_rps']:g} | {s['goodput_rps']:g} | {s['statuses'].get('200', 0)} | "
                     f"{others} | {s['latency_ms']['p50']} | {s['latency_ms']['p90']} | {s['latency_ms']['p99']} | "
                     f"{s['refused_latency_ms']['p99'] or '-'} | {fill} | {idle} | "
                     f"{s.get('cpu_ms_per_request', '-')} |")
    split = {n: s["cpu_ms_per_request_by_process"] for n, s in bench.results.items()
             if s.get("cpu_ms_per_request_by_process") and n.startswith("system-")}
    if split:
        roles = sorted({r for row in split.values() for r in row})
        lines += ["", "CPU ms per request, by process:", "",
                  "| scenario | " + " | ".join(roles) + " | all |", "|---" * (len(roles) + 2) + "|"]
        lines += [f"| {n} | " + " | ".join(f"{row.get(r, 0):.3f}" for r in roles) + f" | {sum(row.values()):.3f} |"
                  for n, row in split.items()]
        generator = {n: s.get("generator_cpu_ms_per_request") for n, s in bench.results.items() if n in split}
        lines += ["", "The load generator's own CPU ms per request (same cores, not counted above): "
                  + ", ".join(f"{n} {v}" for n, v in generator.items() if v is not None) + "."]
    lines += ["", "| target | limit | measured | met |", "|---|---|---|---|"]
    for t, lim, m, ok in targets(bench):
        lines.append(f"| {t} | {lim} | {m} | {'yes' if ok else 'no' if ok is not None else '-'} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    if plots:
        from bench.plots import draw

        draw(report, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch-ms", type=float, default=250.0)
    ap.add_argument("--max-batch", type=int, default=100)
    ap.add_argument("--max-wait-ms", type=float, default=20.0)
    ap.add_argument("--wait-mode", choices=["fixed", "adaptive"], default="adaptive",
                    help="the shipped default; 'fixed' is the reference's own policy (bench/tenants.py compares them)")
    ap.add_argument("--web-workers", type=int, default=2)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per scenario")
    ap.add_argument("--timeout-ms", type=int, default=4500, help="deadline of every request, sent to the server")
    ap.add_argument("--client-timeout-ms", type=int, default=5000, help="when the client gives up")
    ap.add_argument("--loads", type=float, nargs="+", default=[10, 50, 90, 150, 300],
                    help="offered load, percent of capacity")
    ap.add_argument("--ref-loads", type=float, nargs="+", default=[10, 50, 90, 150, 300])
    ap.add_argument("--lone-requests", type=int, default=21, help="sequential requests for the overhead figure")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "latest")
    ap.add_argument("--keep-alive", action="store_true",
                    help="clients reuse connections, as a pool does (default: one new connection per request)")
    ap.add_argument("--smoke", action="store_true", help="a few seconds: two loads, no fault scenarios")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-secondary", action="store_true",
                    help="skip the secondary table (2 workers x 1 s batches: where the plumbing is not the limit)")
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.loads, args.ref_loads = min(args.duration, 2.0), [10, 90], [10]
        args.lone_requests = 3
        if args.out == ROOT / "bench" / "results" / "latest":
            args.out = Path(tempfile.mkdtemp(prefix="llmb-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, args.out)
    print(f"capacity {bench.capacity:g} requests/s; results in {args.out}", flush=True)
    bench.run_reference()
    bench.run_system()
    write_report(bench, plots=not args.no_plots)
    if not (args.smoke or args.no_secondary):
        secondary = argparse.Namespace(**{**vars(args), "workers": 2, "batch_ms": 1000.0, "loads": [10, 90, 150, 200],
                                          "out": args.out / "secondary"})
        secondary.out.mkdir(parents=True, exist_ok=True)
        second = Bench(secondary, secondary.out)
        print(f"secondary: capacity {second.capacity:g} requests/s; results in {secondary.out}", flush=True)
        second.run_system()
        write_report(second, plots=False)
        table = (secondary.out / "summary.md").read_text().split("\n", 2)[2]  # without its title
        with (args.out / "summary.md").open("a") as f:
            f.write("\n## Secondary: 2 workers × 1 s batches\n\n" + table)
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
