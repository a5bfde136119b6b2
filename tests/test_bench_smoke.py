"""The benchmark, in its few-second smoke form, so that it keeps working (speed is not asserted here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.stack import ROOT


def test_the_benchmark_runs_end_to_end_and_writes_its_report(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.run", "--smoke", "--no-plots", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["capacity_rps"] == 200
    for name in ("reference-10%", "system-10%", "system-90%"):
        scenario = report["scenarios"][name]
        assert scenario["sent"] > 0 and scenario["statuses"].get("200", 0) > 0
        assert scenario["cpu_ms_per_request"] >= 0, name  # a 2-second run may fall within one clock tick
    assert report["scenarios"]["system-90%"]["cpu_ms_per_request"] > 0
    assert report["scenarios"]["system-90%"]["batches"] > 0
    assert {t["target"] for t in report["targets"]} >= {"90% load: answered 200",
                                                          "callers answered > 100 ms after their deadline"}
    assert "| target | limit | measured | met |" in (tmp_path / "summary.md").read_text()
