"""Token-fair sharing on a generation model, end to end (sim-lm worker, real processes).

Two tenants of equal weight, both backlogged: one sends 1,600-token prompts, the other 16-token ones (in calls
of 100 prompts, so both keep about 40,000 tokens waiting). Fairness charges what a request costs (prompt +
output tokens, estimated at admission, corrected by what the worker reports), so their token throughput is
within 10% of each other: the short-prompt tenant gets its share in many more requests, not the same number.
The KV cache is kept small (8,192 tokens) so that the batcher, not the device, is where work waits.
"""
from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import requests

from harness.stack import running_stack, wait_for


@pytest.mark.fault
def test_long_and_short_prompt_tenants_get_token_throughput_within_ten_percent(tmp_path: Path) -> None:
    with running_stack(tmp_path, workers=[(0, {"backend": "sim-lm"})], web_workers=1, sim_lm_kv_tokens=8192,
                       sim_lm_eos_mean=0, sim_lm_speed=4, kv_admission_factor=100, heartbeat_interval_s=0.25,
                       heartbeat_stale_factor=4) as s:
        tokens: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        failures: list[str] = []
        measuring, stop = threading.Event(), threading.Event()

        def tenant(name: str, prompt: str | list[str]) -> None:
            while not stop.is_set():
                r = requests.post(s.url + "/v1/completions", headers={"X-Tenant": name}, timeout=60,
                                  json={"model": "sim-lm", "prompt": prompt, "max_tokens": 20, "temperature": 0})
                if r.status_code != 200:
                    failures.append(f"{name}: {r.status_code} {r.text[:200]}")
                elif measuring.is_set() and not stop.is_set():
                    usage = r.json()["usage"]
                    tokens[name] += usage["prompt_tokens"] + usage["completion_tokens"]
                    calls[name] += 1

        threads = [threading.Thread(target=tenant, args=("long", "abcd " * 1600)) for _ in range(20)]
        threads += [threading.Thread(target=tenant, args=("short", ["abcd " * 16] * 100)) for _ in range(10)]
        for t in threads:
            t.start()
        wait_for(lambda: s.tenant_inflight("long") > 0 and s.tenant_inflight("short") > 0, 30,
                 "both tenants backlogged")
        measuring.set()
        wait_for(lambda: calls["long"] >= 200 and calls["short"] >= 80, 120, "enough answers of both tenants")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        ratio = tokens["long"] / tokens["short"]
        print(f"\n[token fairness] tokens {dict(tokens)}, calls {dict(calls)}, long/short {ratio:.3f}")
        assert not failures, failures[:3]
        assert 0.9 <= ratio <= 1.1, f"token throughput long/short = {ratio:.3f}: {dict(tokens)}"
