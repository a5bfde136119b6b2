"""`llmb-admin workers` and `stats`: what the GPU fleet and the queues are doing now.

Read-only: heartbeats, admission and quarantine state from Redis, the request queue's depth from RabbitMQ.
"""
from __future__ import annotations

import json
import time
from typing import Any

import click
import redis

from tasks.cli.main import Admin, cli, fail, first_line, pass_admin, shown_url
from tasks.schema import WorkerInfo
from tasks.state.metrics import Stats
from tasks.state.model_load import model_report


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_admin
def workers(admin: Admin, as_json: bool) -> None:
    """The fleet, from heartbeats: state, backlog and speed of every GPU worker."""
    try:
        fleet = admin.fleet()
        now = admin.clock()()
        rows = sorted(fleet.all(), key=lambda w: w.id)
    except redis.RedisError as exc:
        fail(f"cannot reach Redis at {shown_url(admin.settings.stores.redis_url)}: "
             f"{first_line(exc, admin.settings.stores.redis_url)}")
    if as_json:
        click.echo(json.dumps([{**w.__dict__, "live": now - w.heartbeat_at <= fleet.stale_after_s}
                               for w in rows], indent=2))
        return
    if not rows:
        click.echo("no GPU worker has sent a heartbeat (start one with `gpu-worker --gpu 0`)")
        return
    click.echo(f"{'WORKER':<28} {'MODEL':<16} {'STATE':<6} {'QUEUED':>6} {'FREE IN':>9} {'BATCH':>9} "
               f"{'DONE':>7} {'TOK/S':>8} {'UTIL':>5} {'KV USED':>9} {'PREFIX HIT':>10} {'BLOCKS':>7} "
               f"{'SEEN':>6}  QUEUE")
    for w in rows:
        age = now - w.heartbeat_at
        state = w.state if age <= fleet.stale_after_s else "STALE"
        click.echo(f"{w.id:<28} {w.model:<16} {state:<6} {w.outstanding:>6} {w.free_in_ms:>7.0f}ms "
                   f"{w.batch_ms_estimate:>7.0f}ms {w.completed:>7} {w.tokens_per_s:>8.1f} {w.utilisation:>5.0%} "
                   f"{_kv(w):>9} {_hit_rate(w):>10} {w.cached_blocks:>7} {age:>5.1f}s  {w.queue}")
    serving = [w for w in rows if w.max_adapters > 0]
    if serving:  # LoRA adapters (issue 44): resident (most recently used first), loading, loads and evictions
        click.echo(f"\n{'WORKER':<28} {'ADAPTERS':>8} {'LOADS':>7} {'EVICTED':>7}  RESIDENT (MRU FIRST) / LOADING")
        for w in serving:
            loading = f" / loading {', '.join(w.adapters_loading)}" if w.adapters_loading else ""
            click.echo(f"{w.id:<28} {len(w.adapters):>3}/{w.max_adapters:<4} {w.adapter_loads:>7} "
                       f"{w.adapter_evictions:>7}  {_names(w.adapters)}{loading}")


def _kv(w: WorkerInfo) -> str:
    """KV cache in use, as a share of the worker's budget ('-' where it advertises none)."""
    return f"{w.kv_used / w.kv_tokens:.0%}" if w.kv_tokens else "-"


def _names(names: tuple[str, ...], shown: int = 8) -> str:
    """The first few adapter names, then how many more ('-' for none)."""
    if not names:
        return "-"
    more = f" +{len(names) - shown}" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _hit_rate(w: WorkerInfo) -> str:
    """Share of the prompt pages looked up that its prefix cache held ('-' before any look-up)."""
    return f"{w.prefix_hits / w.prefix_queries:.0%}" if w.prefix_queries else "-"


@cli.command()
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between the two samples that rates are computed from.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_admin
def stats(admin: Admin, interval: float, as_json: bool) -> None:
    """Queue depth, age of the oldest waiting request, batches per second and how full they are; per model, the
    autoscaling signal (oldest queued request, arrival rate, recommended workers)."""
    s = admin.settings
    try:
        counters = Stats.from_settings(s, admin.redis)
        before = counters.counters()
        time.sleep(interval)
        after = counters.counters()
        now = admin.clock()()
        admission = admin.admission()
        in_flight = admission.in_flight(now)
        oldest = admission.oldest_arrival()
        quarantined = admin.quarantine().count()
        live_workers = admin.fleet().live(now)
        live = len(live_workers)
        models = model_report(admission, live_workers, now, s.tenants.scale_headroom)
    except redis.RedisError as exc:
        fail(f"cannot reach Redis at {shown_url(s.stores.redis_url)}: {first_line(exc, s.stores.redis_url)}")
    queued: int | None
    try:
        queued = admin.publisher().queue_depth()
    except Exception as exc:
        queued = None
        click.echo(f"warning: cannot read the request queue from RabbitMQ: {first_line(exc, s.broker.url)}", err=True)
    items, batches, tokens = (after[n] - before[n] for n in ("items_done", "batches_done", "tokens"))
    tokens_per_s = tokens / interval
    devices_cost_per_s = s.models.device_price_per_hour * live / 3600
    report: dict[str, Any] = {
        "queue_depth": queued,
        "in_flight": in_flight,
        "oldest_waiting_s": round(now - oldest, 3) if oldest is not None else 0.0,
        "batches_per_s": round(batches / interval, 2),
        "items_per_s": round(items / interval, 2),
        "fill_ratio": round(items / (batches * s.batcher.max_batch_size), 3) if batches else None,
        "live_workers": live,
        "tokens_per_s": round(tokens_per_s, 1),
        # the workers' own figure (last minute): batches running at once on a device count once
        "device_busy_fraction": round(sum(w.utilisation for w in live_workers) / live, 3) if live else None,
        "cost_per_million_tokens": round(devices_cost_per_s / tokens_per_s * 1e6, 4) if tokens_per_s else None,
        "quarantined_inputs": quarantined,
        "ledger_records_dropped": after["ledger_dropped"],
    }
    if as_json:
        click.echo(json.dumps({**report, "models": models}, indent=2))
        return
    for key, value in report.items():
        click.echo(f"{key.replace('_', ' '):<24} {'-' if value is None else value}")
    if models:
        click.echo(f"\n{'MODEL':<24} {'WORKERS':>7} {'OLDEST':>8} {'ITEMS/S':>8} {'BATCH':>8} {'RECOMMENDED':>11}")
    for m in models:
        batch = "-" if m["batch_ms"] is None else f"{m['batch_ms']:.0f}ms"
        rec = "-" if m["recommended_workers"] is None else m["recommended_workers"]
        click.echo(f"{m['model']:<24} {m['workers']:>7} {m['oldest_queued_s']:>7.2f}s {m['arrival_rate_per_s']:>8.1f} "
                   f"{batch:>8} {rec:>11}")
