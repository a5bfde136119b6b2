"""The benchmark, in its few-second smoke form, so that it keeps working (speed is not asserted here: its figures
are checked for being consistent with each other and with a working system, not for being fast)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.stack import ROOT

HTTP_ANSWERS = {"200", "429", "503", "504"}  # what a working system answers an open-loop load with


def check_load(name: str, s: dict[str, Any], duration_s: float) -> None:
    """One scenario of bench/load.py: every request accounted for once, the figures consistent with each other."""
    sent, statuses = s["sent"], s["statuses"]
    ok = statuses.get("200", 0)
    assert sent > 0 and sum(statuses.values()) == sent, (name, s)  # one record per request sent
    assert set(statuses) <= HTTP_ANSWERS, (name, statuses)  # every request got an HTTP answer
    assert ok > 0 and s["ok_fraction"] == round(ok / sent, 4), (name, s)
    # goodput: 200s per second of the run, which lasts at least the arrivals' duration
    assert 0 < s["goodput_rps"] <= round(ok / duration_s, 1), (name, s)
    lat = s["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"], (name, lat)
    assert s["mean_batch_size_seen"] >= 1, (name, s)
    # CPU of the processes measured, over the scenario: none negative, never more than every core for its wall time
    cpu_s = s["cpu_ms_per_request"] * sent / 1000
    assert 0 <= cpu_s <= s["wall_s"] * (os.cpu_count() or 1), (name, s["cpu_ms_per_request"], s["wall_s"])


def test_the_benchmark_runs_end_to_end_and_writes_its_report(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.run", "--smoke", "--no-plots", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    config = report["config"]
    assert report["capacity_rps"] == 400  # the headline scenario: one worker, 100 per 250 ms
    assert report["capacity_rps"] == config["workers"] * config["max_batch"] / (config["batch_ms"] / 1000)
    scenarios = report["scenarios"]
    for name in ("reference-10%", "system-10%", "system-90%"):
        scenario = scenarios[name]
        check_load(name, scenario, config["duration"])
        assert scenario["mean_batch_size_seen"] <= config["max_batch"], (name, scenario)
    for name in ("reference-10%", "system-10%"):  # a tenth of capacity: every caller is answered with its output
        assert scenarios[name]["statuses"] == {"200": scenarios[name]["sent"]}, (name, scenarios[name])
    for name in ("system-10%", "system-90%"):  # the system's processes did work; its workers' figures add up
        scenario = scenarios[name]
        assert scenario["cpu_ms_per_request"] > 0, name
        batches, fill = scenario["batches"], scenario["batch_fill"]
        assert 0 < batches <= scenario["sent"], (name, scenario)
        assert batches == sum(scenario["batch_size_buckets"].values()), (name, scenario)
        items = fill * batches * config["max_batch"]  # items run; batch_fill is rounded to 3 decimals
        slack = 0.0005 * batches * config["max_batch"] + 1e-6
        assert scenario["statuses"].get("200", 0) - slack <= items <= scenario["sent"] + slack, (name, scenario)
        assert 0 <= scenario["device_idle_fraction"] < 1, (name, scenario)
    for name in ("reference-lone", "system-lone"):  # one request at a time: each waits at least one batch
        lone = scenarios[name]
        assert lone["requests"] == config["lone_requests"], (name, lone)
        assert lone["p50_ms"] >= config["batch_ms"], (name, lone)
        assert abs(lone["overhead_ms"] - (lone["p50_ms"] - config["batch_ms"] - config["max_wait_ms"])) < 0.02, lone
    targets = {t["target"]: t for t in report["targets"]}
    assert set(targets) >= {"90% load: answered 200", "callers answered > 100 ms after their deadline"}
    assert all(t["met"] in (True, False, None) and t["measured"] for t in targets.values()), targets
    late = sum(s.get("late_over_100ms", 0) for k, s in scenarios.items() if k.startswith(("system", "poison", "fault")))
    assert targets["callers answered > 100 ms after their deadline"]["measured"] == str(late)
    assert "| target | limit | measured | met |" in (tmp_path / "summary.md").read_text()


def test_the_load_generator_reuses_connections_with_keep_alive(tmp_path: Path) -> None:
    """``bench/load.py --keep-alive`` (a client's connection pool) against the in-process reference: every request
    answered once, on far fewer connections than requests; without it, one connection per request."""
    from harness.stack import free_port, wait_for

    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "reference.py"), "--port", str(port),
                               "--devices", "1", "--batch-ms", "50"], cwd=ROOT, start_new_session=True)
    try:
        import socket

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(up, 20, "the reference server")
        runs = {}
        for mode in ("new", "keep-alive"):
            out = tmp_path / f"{mode}.json"
            argv = [sys.executable, "-m", "bench.load", "--url", f"http://127.0.0.1:{port}", "--rate",
                    "100", "--duration", "2", "--out", str(out)] + (["--keep-alive"] if mode == "keep-alive" else [])
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            runs[mode] = json.loads(out.read_text())["summary"]
        for mode, s in runs.items():
            assert s["statuses"] == {"200": s["sent"]} and s["sent"] > 100, (mode, s)
        assert runs["new"]["connections"] == runs["new"]["sent"]
        assert runs["keep-alive"]["connections"] < runs["keep-alive"]["sent"] / 2, runs["keep-alive"]
    finally:
        os.killpg(server.pid, 15)
        server.wait(10)
