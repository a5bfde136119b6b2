"""bench/llm.py at a tiny scale, so that it keeps working: the report has its shape and its figures agree with
each other and with the load offered (no speed is asserted: this machine's timing is not the benchmark's)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import llm

REQUESTS, MAX_TOKENS = 10, 120


def test_the_llm_benchmark_reports_both_modes_and_the_embeddings(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    report = llm.main(["--requests", str(REQUESTS), "--rate", "2", "--speed", "50", "--max-tokens", str(MAX_TOKENS),
                       "--embed-seconds", "0.2", "--no-pipeline-embed", "--json", str(out)])
    runs = {"continuous", "static", "continuous, 32 slots"}
    assert json.loads(out.read_text())["lm"].keys() == report["lm"].keys() == runs
    calls = llm.arrivals(REQUESTS, 2, 10, MAX_TOKENS, 1)
    assert all(10 <= c["max_tokens"] <= MAX_TOKENS for c in calls)
    for name, s in report["lm"].items():
        assert s["name"] == name and s["ok"] == s["requests"] == REQUESTS, s["statuses"]
        # EOS is off: every answer ran to its own max_tokens, the same sequence in both modes
        assert s["output_tokens"] == sum(c["max_tokens"] for c in calls), name
        assert [r["max_tokens"] for r in s["records"]] == [c["max_tokens"] for c in calls]
        for r in s["records"]:
            assert r["finish_reason"] == "length" and r["chunks"] >= 1, r
            assert 0 < r["ttft_ms"] <= r["last_token_ms"] <= r["latency_ms"], r
        for q in ("p50", "p99"):
            assert 0 < s["ttft_ms"][q] <= s["latency_ms"][q], (name, s["ttft_ms"], s["latency_ms"])
        assert s["output_tokens_per_s"] > 0 and 1 <= s["batches"] <= REQUESTS and s["mean_batch_size"] >= 1
        cost = s["cost"]
        assert cost["tokens_per_s"] > cost["output_tokens_per_s"] == s["output_tokens_per_s"]  # prompts count too
        assert s["tokens"] > s["output_tokens"]
        assert 0 < cost["device_busy_any_batch"] <= 1 and cost["device_busy_fraction"] > 0
        assert 0 < cost["cost_per_million_tokens"] < cost["cost_per_million_output_tokens"]
    local = report["embeddings"]["in_process"]
    assert local["batch_1"]["sentences_per_s"] > 0 and local["batch_100"]["sentences_per_s"] > 0
    assert local["batch_100"]["sentences"] >= 200 and len(local["batch_100"]["trials_sentences_per_s"]) == 3
    table = llm.markdown(report)
    assert "| continuous |" in table and "| static |" in table and "| 100 |" in table
