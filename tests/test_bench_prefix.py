"""bench/prefix.py at a tiny scale, so that it keeps working: both routings at one load, every call answered, the
figures in their shape (no speed or ratio is asserted: this machine's timing is not the benchmark's)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import prefix

CALLS, TENANTS = 16, 3


def test_the_prefix_benchmark_runs_both_routings_on_one_trace(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    report = prefix.main(["--workers", "2", "--tenants", str(TENANTS), "--prefix-tokens", "800", "--calls",
                          str(CALLS), "--capacity-calls", "6", "--loads", "50", "--speed", "2", "--json", str(out)])
    assert json.loads(out.read_text())["runs"] == report["runs"]
    assert set(report["capacity"]) == {"least-backlog", "prefix-aware"}
    assert [r["routing"] for r in report["runs"]] == ["least-backlog", "prefix-aware"]
    for run in report["runs"]:
        assert run["load"] == 50 and run["ok"] == run["calls"] == CALLS, run
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["p99"]
        assert run["output_tokens_per_s"] > 0 and 0 <= run["prefix_hit_rate"] <= 1
        assert sum(run["worker_tokens"].values()) > 0 and run["worker_max_over_mean"] >= 1
        assert run["tenant_served_over_asked_max_over_min"] is not None
    trace = prefix.trace(CALLS, 1.0, TENANTS, 7)
    assert trace == prefix.trace(CALLS, 1.0, TENANTS, 7) and {c["tenant"] for c in trace} <= set(range(TENANTS))
    assert "| 50% | prefix-aware |" in prefix.markdown(report)
