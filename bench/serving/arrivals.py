"""The generation benchmark's load: an open-loop Poisson sequence of streamed calls, the same for every run of one
seed, offered whether or not earlier calls have returned."""
from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

from bench.serving.sse import stream_completion
from harness.stats import percentile, rounded

WORDS = ("the", "cat", "sat", "on", "a", "mat", "while", "the", "batch", "ran", "fast", "and", "slow", "on", "red",
         "and", "blue", "workers", "that", "answer", "every", "request", "in", "the", "queue", "with", "a", "token",
         "model", "of", "the", "world")


def arrivals(n: int, rate: float, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    """``n`` calls: Poisson arrival times (modelled-device seconds) at ``rate`` per second, a distinct prompt
    and ``max_tokens`` log-uniform in [lo, hi]. The same seed gives the same sequence."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        out.append({"i": i, "t": t, "prompt": f"request {i}: {words}",
                    "max_tokens": max(lo, min(hi, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))})
        t += rng.expovariate(rate)
    return out


def drive(url: str, calls: list[dict[str, Any]], speed: float, timeout_ms: int, tag: str) -> dict[str, Any]:
    """Offer ``calls`` open loop (each at its time / speed, whether or not earlier ones have returned), one
    thread per call; returns every call's record, the generator's lag and the wall times of the run."""
    records: list[dict[str, Any]] = [{} for _ in calls]
    lags: list[float] = []
    threads: list[threading.Thread] = []

    def one(c: dict[str, Any]) -> None:
        body = {"model": "sim-lm", "prompt": c["prompt"], "max_tokens": c["max_tokens"], "temperature": 0,
                "stream": True, "timeout_ms": timeout_ms}
        rec = stream_completion(url, body, timeout_ms / 1000 + 30, f"{tag}-{c['i']}")
        rec.update(i=c["i"], max_tokens=c["max_tokens"], sent_s=c["t"] / speed)
        records[c["i"]] = rec

    t0, epoch0 = time.monotonic(), time.time()
    for c in calls:
        due = t0 + c["t"] / speed
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        lags.append(max(0.0, time.monotonic() - due) * 1000)
        th = threading.Thread(target=one, args=(c,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=max(1.0, timeout_ms / 1000 + 60 - (time.monotonic() - t0)))
    ends = [r["sent_s"] + (r["latency_ms"] or 0) / 1000 for r in records if r.get("latency_ms") is not None]
    return {"records": records, "wall_s": max(ends, default=time.monotonic() - t0), "epoch0": epoch0,
            "lag_ms": {"p50": rounded(percentile(lags, 50), 2), "p99": rounded(percentile(lags, 99), 2)}}
