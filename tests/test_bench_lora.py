"""bench.lora_engine in its few-second form, so that it keeps working (speed is not asserted: its figures are checked
for being consistent with each other)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="bin/test installs the 'models' extra these tests need")


def test_the_lora_bench_runs_every_scenario_to_its_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from bench.lora_engine import SCENARIOS, main

    threads = torch.get_num_threads()
    try:  # the bench sets one torch thread for the process
        assert main(["--rows", "8", "--max-tokens", "3", "--repeat", "1", "--json", str(tmp_path / "r.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [(r["adapters"], r["cap"]) for r in results] == SCENARIOS
    assert all(r["tokens"] == 8 * 3 and r["tokens_per_s"] > 0 and r["tokens_per_cpu_s"] > 0 for r in results)
    assert "| continuous | 16 | 4 |" in capsys.readouterr().out
