"""KV memory as the concurrency budget, end to end on a sim-lm worker with a small KV cache (2,048 tokens).

Admission counts each generation item's estimated tokens (prompt + max_tokens) against the model's budget
(the fleet's KV caches x LLMB_KV_ADMISSION_FACTOR); the batcher sends a worker no more than its KV room; a
request that could never fit any worker is a 400 at the door.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.stack import Stack, running_stack, wait_for

KV_TOKENS, CONTEXT = 2048, 512


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("kv")), workers=[(0, {"backend": "sim-lm"})], web_workers=1,
                       sim_lm_kv_tokens=KV_TOKENS, sim_lm_max_context=CONTEXT, sim_lm_eos_mean=0,
                       kv_admission_factor=2, heartbeat_interval_s=0.25, heartbeat_stale_factor=4) as s:
        yield s


def complete(url: str, prompt: str, max_tokens: int) -> requests.Response:
    return requests.post(url + "/v1/completions", timeout=60,
                         json={"model": "sim-lm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_a_request_that_could_never_fit_is_a_400_at_the_door(small_kv: Stack) -> None:
    too_big = complete(small_kv.url, "word " * 400, 400)  # at least 125 prompt tokens + 400 > 512
    assert too_big.status_code == 400, too_big.text
    error = too_big.json()["error"]
    assert error["type"] == "invalid_request_error" and "more than any worker" in error["message"]
    fits = complete(small_kv.url, "word " * 20, 16)
    assert fits.status_code == 200, fits.text


def test_tokens_admitted_stay_within_the_budget_and_a_worker_never_holds_more_than_its_kv(small_kv: Stack) -> None:
    """40 concurrent requests of about 200 estimated tokens (8,000) against a budget of 4,096: the excess is
    refused with 429 at once; the rest are all answered, and the worker's KV use never passes its 2,048."""
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # a measurement, not a wait: the worker's reported KV use while the calls run
        while not stop.is_set():
            beat: dict[str, Any] = small_kv.fleet().get("gpu0@test", {})
            seen.append(int(beat.get("kv_used") or 0))
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(lambda i: complete(small_kv.url, f"request {i} " + "abcd " * 78, 100),
                                    range(40)))
    finally:
        stop.set()
        watcher.join()
    codes = [r.status_code for r in answers]
    refused = [r for r in answers if r.status_code == 429]
    assert set(codes) <= {200, 429}, codes
    print(f"\n[kv] {codes.count(200)} answered, {len(refused)} refused; most KV in use {max(seen)} of {KV_TOKENS}")
    assert refused and codes.count(200) >= 10, codes
    assert all("KV memory" in r.json()["error"]["message"] for r in refused), refused[0].text
    assert max(seen) > 0, "the worker never reported KV in use"
    assert max(seen) <= KV_TOKENS, f"the worker held {max(seen)} KV tokens, over its {KV_TOKENS}"
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in answers if r.status_code == 200)


def test_a_short_answer_does_not_wait_for_the_long_one_in_its_batch(tmp_path: Path) -> None:
    """Continuous batching: two calls in one batch, 4 and 400 tokens to generate; the short one is answered as
    its row finishes, while the long one is still generating (not when the batch ends)."""
    with running_stack(tmp_path, workers=[(0, {"backend": "sim-lm"})], web_workers=1, sim_lm_eos_mean=0,
                       wait_mode="fixed", max_wait_ms=300) as s:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(complete, s.url, "a long answer", 400)
            short = pool.submit(complete, s.url, "a short answer", 4)
            assert short.result().status_code == 200, short.result().text
            assert not long.done(), "the short answer came only when the whole batch was done"
            assert long.result().status_code == 200
        assert long.result().json()["usage"]["completion_tokens"] == 400
        wait_for(lambda: " size=2 " in s.log("gpu0"), 10, "the worker's log of the batch the two calls shared")
