"""The fault table: the benchmark's system under steady load while one process (or service) fails.

    python -m bench.faults                      # every fault, ~4 minutes; bench/results/faults.md
    python -m bench.faults --only worker-sigkill batcher-sigkill --duration 6
    bin/bench --faults                          # the same, through the benchmark's entry point

Starts the system of ``bench/run.py`` (gunicorn, the batcher, sim workers, with its defaults: 1000 ms batches
of up to 100, 4000 ms deadlines) on a Redis server of its own and, when ``rabbitmqctl`` can be used, on a
RabbitMQ virtual host of its own, so that restarting Redis and cutting broker connections touch nobody else.
Each fault runs under a steady open-loop load (harness/loadgen.py) of ``--load-pct`` of the fleet's capacity;
the default, 40%, is below what one worker alone can serve, so when a worker is lost every non-200 is a
defect, not a lack of capacity. The fault lands after a third of the arrivals; the system is made whole again
(processes restarted) before the next one. Heartbeats keep the product's defaults unless ``--heartbeat-s``
says otherwise.

Columns: *no answer*: requests that got no HTTP response (refused at connect, connection reset, or the
client's own timeout at deadline + 5 s); *lost*: those of them that reached a server and never heard back
(reset or timed out: admitted, perhaps, and never resolved; a refused connection was never admitted);
*late*: any answer later than deadline + 1 s; *held*: admission slots still taken 5 s after the load stopped
(capacity leaked by callers nobody will answer).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.loadgen import LoadReport, SteadyLoad
from harness.services import PrivateRedis, Vhost
from harness.stack import Stack, alive, wait_for

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results" / "faults.md"
DOCS = ROOT / "docs" / "bench" / "faults.md"


@dataclass
class Ctx:
    stack: Stack
    redis: PrivateRedis
    vhost: Vhost | None
    load: SteadyLoad
    notes: list[str]
    workers: int
    web_workers: int
    batch_s: float


def _busy(ctx: Ctx, device: int) -> None:
    """Wait (a little) for the victim to be running a batch, so the kill lands mid-batch."""
    try:
        wait_for(lambda: ctx.stack.fleet().get(f"gpu{device}@test", {}).get("state") == "busy", 5,
                 f"gpu{device} busy")
    except TimeoutError:
        ctx.notes.append("victim idle when hit")


def worker_sigkill(ctx: Ctx) -> None:
    _busy(ctx, 0)
    ctx.stack.kill("gpu0", signal.SIGKILL)  # the supervisor and its worker: a lost host, not restarted here


def _early(ctx: Ctx, device: int) -> None:
    """Wait for the victim to be early in a batch: the batcher will hand it the next one while it stops."""
    try:
        ctx.stack.wait_batch_start(device, within_s=ctx.batch_s / 2, timeout_s=10, batch_s=ctx.batch_s)
    except TimeoutError:
        ctx.notes.append("victim not seen early in a batch")


def worker_sigterm(ctx: Ctx) -> None:
    _early(ctx, 0)
    child = ctx.stack.worker_child(0)
    started = time.monotonic()
    ctx.stack.signal("gpu0", signal.SIGTERM)
    rc = ctx.stack.wait_exit("gpu0", timeout_s=60)
    ctx.notes.append(f"supervisor exit {rc} after {time.monotonic() - started:.1f} s"
                     + ("; its worker still running" if alive(child) else ""))


def worker_child_sigkill(ctx: Ctx) -> None:
    _busy(ctx, 0)
    child = ctx.stack.worker_child(0)
    os.kill(child, signal.SIGKILL)
    started = time.monotonic()
    try:
        wait_for(lambda: (ctx.stack.children("gpu0") or [child])[-1] != child, 15, "a restarted worker")
        ctx.notes.append(f"restarted by its supervisor in {time.monotonic() - started:.1f} s")
    except TimeoutError:
        ctx.notes.append("not restarted within 15 s")


def supervisor_sigkill(ctx: Ctx) -> None:
    child = ctx.stack.worker_child(0)
    ctx.stack.signal("gpu0", signal.SIGKILL)
    ctx.stack.wait_exit("gpu0", timeout_s=10)
    try:
        wait_for(lambda: not alive(child), 10, "the orphaned worker to stop")
        ctx.notes.append("orphaned worker stopped")
    except TimeoutError:  # stop it gracefully, so that the row shows the orphan, not a second fault
        ctx.notes.append("orphaned worker still serving after 10 s (then sent SIGTERM)")
        os.kill(child, signal.SIGTERM)
        try:
            wait_for(lambda: not alive(child), 30, "the orphaned worker to stop on SIGTERM")
        except TimeoutError:
            os.kill(child, signal.SIGKILL)


def batcher_sigkill(ctx: Ctx) -> None:
    ctx.stack.kill("batcher", signal.SIGKILL)
    ctx.stack.start_batcher()


def batcher_sigterm(ctx: Ctx) -> None:
    started = time.monotonic()
    ctx.stack.kill("batcher", signal.SIGTERM)
    ctx.notes.append(f"stopped in {time.monotonic() - started:.1f} s")
    ctx.stack.start_batcher()


def api_worker_sigkill(ctx: Ctx) -> None:
    victim = ctx.stack.web_workers()[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in ctx.stack.web_workers() and len(ctx.stack.web_workers()) == ctx.web_workers,
             20, "gunicorn to replace its worker")


def gunicorn_sigterm(ctx: Ctx) -> None:
    started = time.monotonic()
    ctx.stack.signal("web", signal.SIGTERM)
    rc = ctx.stack.wait_exit("web", timeout_s=60)
    ctx.notes.append(f"exit {rc} after {time.monotonic() - started:.1f} s; new server started")
    ctx.load.retarget(ctx.stack.start_web(workers=ctx.web_workers))


def redis_restart(ctx: Ctx) -> None:
    started = time.monotonic()
    ctx.redis.stop()
    ctx.redis.start()  # empty: no persistence, like a failover to a replica that had not caught up
    ctx.notes.append(f"down {time.monotonic() - started:.1f} s, restarted empty")


def broker_cut(ctx: Ctx) -> None:
    assert ctx.vhost is not None
    ctx.vhost.close_connections("fault injection")
    ctx.notes.append("every connection of the vhost closed by the broker")


FAULTS: dict[str, tuple[str, Callable[[Ctx], None] | None]] = {
    "none": ("no fault (baseline)", None),
    "worker-sigkill": ("GPU worker SIGKILL (supervisor + worker: lost host)", worker_sigkill),
    "worker-sigterm": ("GPU worker SIGTERM to the supervisor (graceful stop)", worker_sigterm),
    "worker-child-sigkill": ("GPU worker process SIGKILL (supervisor restarts it)", worker_child_sigkill),
    "supervisor-sigkill": ("GPU worker supervisor SIGKILL alone", supervisor_sigkill),
    "batcher-sigkill": ("batcher SIGKILL, restarted", batcher_sigkill),
    "batcher-sigterm": ("batcher SIGTERM, restarted", batcher_sigterm),
    "api-worker-sigkill": ("API (gunicorn worker) process SIGKILL", api_worker_sigkill),
    "gunicorn-sigterm": ("gunicorn SIGTERM (graceful), a new one started", gunicorn_sigterm),
    "redis-restart": ("Redis restarted (empty)", redis_restart),
    "broker-cut": ("RabbitMQ connections cut", broker_cut),
}


def run_fault(ctx_base: dict[str, Any], key: str, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    title, inject = FAULTS[key]
    stack: Stack = ctx_base["stack"]
    restarted = stack.restart_missing(workers=args.workers, web_workers=args.web_workers)
    stack.wait_serving(workers=args.workers, web_workers=args.web_workers, timeout_s=60)
    load = SteadyLoad(stack.url, rate, timeout_ms=args.timeout_ms, prefix=f"fault-{key}", max_workers=400)
    ctx = Ctx(stack, ctx_base["redis"], ctx_base["vhost"], load, [], args.workers, args.web_workers,
              args.batch_ms / 1000)
    load.start()
    hit_at, hit_t = None, float("inf")
    try:
        before = int(rate * args.duration / 3)
        wait_for(lambda: load.sent >= before, args.duration + 30, "arrivals before the fault")
        hit_at = load.sent
        hit_t = time.monotonic()
        if inject is not None:
            inject(ctx)
        total = int(rate * args.duration)
        wait_for(lambda: load.sent >= total, args.duration + 120, "arrivals after the fault")
    except Exception as exc:  # the table reports a fault that could not be injected rather than dying
        ctx.notes.append(f"injection failed: {type(exc).__name__}: {exc}")
    finally:
        report = load.stop()
    held = None
    try:
        wait_for(lambda: stack.inflight() == 0, 5, "admission released")
        held = 0
    except TimeoutError:
        held = stack.inflight()
    except Exception:
        held = -1
    early = [o for o in report.outcomes if o.sent_at < hit_t and o.status != 200]
    if early:
        kinds = sorted({str(o.status or o.no_answer) for o in early})
        ctx.notes.append(f"{len(early)} of them sent before the fault ({', '.join(kinds)})")
    row = row_of(key, title, report, held, ctx.notes, hit_at)
    if restarted:
        row["restarted_before"] = restarted
    print(f"  {key:<22} {report.summary()}  held {held}  {'; '.join(ctx.notes)}", flush=True)
    return row


def row_of(key: str, title: str, report: LoadReport, held: int | None, notes: list[str],
           hit_at: int | None) -> dict[str, Any]:
    lost = sum(n for kind, n in report.no_answer_kinds.items() if kind != "refused")
    return {"fault": key, "title": title, "sent": report.sent, "200": report.statuses.get(200, 0),
            "4xx": report.count(400, 499), "5xx": report.count(500, 599), "no_answer": report.no_answer,
            "late": report.late, "wrong_output": report.wrong_output, "lost": lost, "held": held,
            "non_json": report.non_json, "statuses": {str(k): v for k, v in sorted(report.statuses.items())},
            "errors": dict(report.error_types), "no_answer_kinds": dict(report.no_answer_kinds),
            "error_examples": report.error_examples,
            "error_messages": dict(report.error_messages.most_common(5)), "p50_ms": round(report.p(50), 1),
            "p99_ms": round(report.p(99), 1), "fault_after_requests": hit_at,
            "notes": notes}


def table(rows: list[dict[str, Any]], args: argparse.Namespace, rate: float, capacity: float,
          broker_note: str) -> str:
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    lines = [f"# Faults under load, {date[:10]}", "",
             f"{args.workers} sim worker(s), {args.batch_ms:g} ms per batch of up to {args.max_batch} (capacity "
             f"{capacity:g} requests/s), {args.web_workers} gunicorn process(es); steady open-loop load of "
             f"**{rate:g} requests/s** ({args.load_pct:g}% of capacity) for {args.duration:g} s per fault, deadline "
             f"{args.timeout_ms} ms, heartbeat {args.heartbeat_s:g} s (stale after {args.stale_factor:g}). The fault "
             f"lands after a third of the arrivals. Generated by `python -m bench.faults`.{broker_note}", "",
             "| fault | sent | 200 | 4xx | 5xx | no answer | late (> deadline+1 s) | wrong output | lost | held "
             "after 5 s | p99 ms | details |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        details = [f"{k} {v}" for k, v in r["errors"].items()]
        details += [f"no answer: {k} {v}" for k, v in r["no_answer_kinds"].items()]
        if r["non_json"]:
            details.append(f"non-JSON {r['non_json']}")
        details += r["notes"]
        lines.append(f"| {r['title']} | {r['sent']} | {r['200']} | {r['4xx']} | {r['5xx']} | {r['no_answer']} | "
                     f"{r['late']} | {r['wrong_output']} | {r['lost']} | {r['held']} | {r['p99_ms']:g} | "
                     f"{'; '.join(details) or '-'} |")
    examples = [f"- {r['fault']}: {n} × {m}" for r in rows for m, n in r["error_messages"].items()]
    if examples:
        lines += ["", "Error messages seen (the most common per fault):", "", *examples]
    lines += ["", "*no answer*: no HTTP response (refused at connect, reset, or the client's own timeout at "
              "deadline + 5 s). *lost*: of those, the ones that reached a server and never heard back (reset or "
              "timed out). *held after 5 s*: admission slots still taken 5 s after the load stopped. A sound "
              "system shows 0 in late, wrong output and lost for every fault, and only 200 where the surviving "
              "capacity carries the load."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-ms", type=float, default=1000.0)
    ap.add_argument("--max-batch", type=int, default=100)
    ap.add_argument("--max-wait-ms", type=float, default=20.0)
    ap.add_argument("--web-workers", type=int, default=2)
    ap.add_argument("--load-pct", type=float, default=40.0, help="offered load, percent of the fleet's capacity")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per fault")
    ap.add_argument("--timeout-ms", type=int, default=4000, help="deadline of every request")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="worker heartbeat interval (product default)")
    ap.add_argument("--stale-factor", type=float, default=3.0, help="heartbeats missed before a worker is lost")
    ap.add_argument("--only", nargs="+", choices=list(FAULTS), help="run only these faults")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the markdown table (also written as .json)")
    ap.add_argument("--no-docs", action="store_true", help=f"do not copy the table to {DOCS.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    capacity = args.workers * args.max_batch / (args.batch_ms / 1000)
    rate = capacity * args.load_pct / 100
    keys = args.only or list(FAULTS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.parent / "faults-system"

    redis_server = PrivateRedis().start()
    vhost: Vhost | None = None
    broker_note = ""
    if any(k == "broker-cut" for k in keys):
        if Vhost.available():
            vhost = Vhost().create()
        else:
            keys = [k for k in keys if k != "broker-cut"]
            broker_note = " Broker connections were not cut: `rabbitmqctl` is not usable here."
    env: dict[str, object] = dict(sim_batch_ms=args.batch_ms, max_batch_size=args.max_batch,
                                  max_wait_ms=args.max_wait_ms, wait_mode="fixed", log_level="WARNING",
                                  redis_url=redis_server.url, heartbeat_interval_s=args.heartbeat_s,
                                  heartbeat_stale_factor=args.stale_factor)
    if vhost is not None:
        env["broker_url"] = vhost.url
    stack = Stack(work, **env)
    rows: list[dict[str, Any]] = []
    print(f"capacity {capacity:g} requests/s; load {rate:g} requests/s; faults: {', '.join(keys)}", flush=True)
    try:
        base = {"stack": stack, "redis": redis_server, "vhost": vhost}
        for key in keys:
            rows.append(run_fault(base, key, args, rate))
    finally:
        stack.close()
        redis_server.stop()
        if vhost is not None:
            vhost.delete()
    text = table(rows, args, rate, capacity, broker_note)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                         "rate": rate, "capacity": capacity, "rows": rows},
                                                        indent=2))
    if not args.no_docs and args.only is None:
        DOCS.parent.mkdir(parents=True, exist_ok=True)
        DOCS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
