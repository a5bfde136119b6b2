"""PNG plots of a benchmark report (matplotlib, installed with the `bench` extra)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _sweep(report: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    rows = [s for name, s in report["scenarios"].items() if name.startswith(prefix) and "offered_pct" in s]
    return sorted(rows, key=lambda s: s["offered_pct"])


def draw(report: dict[str, Any], out: Path) -> None:
    system, reference = _sweep(report, "system-"), _sweep(report, "reference-")
    capacity = report["capacity_rps"]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rows, style, label in ((system, "-", "system"), (reference, "--", "in-process reference")):
        for q, color in (("p50", "tab:blue"), ("p90", "tab:orange"), ("p99", "tab:red")):
            points = [(s["offered_pct"], s["latency_ms"][q]) for s in rows if s["latency_ms"][q] is not None]
            if points:
                ax.plot(*zip(*points), style, marker="o", color=color, label=f"{label} {q}")
    ax.set(xlabel="offered load (% of capacity)", ylabel="latency of answered requests (ms)",
           title="Latency against offered load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_load.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rows, style, label in ((system, "-o", "system"), (reference, "--s", "in-process reference")):
        ax.plot([s["offered_rps"] for s in rows], [s["goodput_rps"] for s in rows], style, label=label)
    top = max([s["offered_rps"] for s in system + reference] + [capacity])
    ax.plot([0, top], [0, top], ":", color="grey", label="goodput = offered")
    ax.axhline(capacity, color="black", linewidth=1, label=f"capacity {capacity:g}/s")
    ax.set(xlabel="offered (requests/s)", ylabel="answered 200 (requests/s)", title="Goodput against offered load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "goodput_vs_load.png", dpi=110)
    plt.close(fig)

    split = [s for s in system if s.get("cpu_ms_per_request_by_process")]
    if split:
        roles = sorted({r for s in split for r in s["cpu_ms_per_request_by_process"]})
        fig, ax = plt.subplots(figsize=(7, 4.5))
        bottom = [0.0] * len(split)
        labels = [f"{s['offered_pct']:g}%" for s in split]
        for role in roles:
            values = [s["cpu_ms_per_request_by_process"].get(role, 0.0) for s in split]
            ax.bar(labels, values, bottom=bottom, label=role)
            bottom = [b + v for b, v in zip(bottom, values)]
        ref = [s["cpu_ms_per_request"] for s in reference]
        if ref:
            ax.axhline(min(ref), color="black", linestyle="--", linewidth=1, label="in-process reference (best)")
        ax.set(xlabel="offered load (% of capacity)", ylabel="CPU ms per request",
               title="CPU per request, by process")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "cpu_by_process.png", dpi=110)
        plt.close(fig)

    saturated = next((s for s in reversed(system) if s.get("batch_size_buckets")), None)
    if saturated:
        buckets = sorted(saturated["batch_size_buckets"].items(),
                         key=lambda kv: float("inf") if kv[0] == "+Inf" else float(kv[0]))
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([f"≤{k.replace('.0', '')}" for k, _ in buckets], [v for _, v in buckets], color="tab:green")
        ax.set(xlabel="batch size", ylabel="batches",
               title=f"Batch sizes at {saturated['offered_pct']:g}% of capacity")
        fig.tight_layout()
        fig.savefig(out / "batch_sizes.png", dpi=110)
        plt.close(fig)

    fault = report["scenarios"].get("fault-sigkill-worker")
    records_file = out / "fault.requests.json"
    if fault and records_file.exists():
        records = json.loads(records_file.read_text())["records"]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for status, color in ((200, "tab:blue"), (429, "tab:orange"), (504, "tab:red")):
            pts = [(r["t"], r["ms"]) for r in records if r["status"] == status]
            if pts:
                ax.scatter([t for t, _ in pts], [ms for _, ms in pts], s=3, color=color, label=str(status))
        ax.axvline(fault["killed_at_s"], color="black", linestyle="--", label="worker SIGKILLed")
        ax.set(xlabel="time request was sent (s)", ylabel="latency (ms)",
               title="Latency over time around a worker crash (60% load)")
        ax.legend(fontsize=8, markerscale=3)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "fault_timeline.png", dpi=110)
        plt.close(fig)
