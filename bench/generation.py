"""Static batches against continuous batching for generation, in process, with requests arriving over time.

    python -m bench.generation [--model PATH] [--rate 50] [--duration 5]

Requests arrive as a Poisson process and ask for 4 to 64 new tokens (mixed lengths: the case where a
padded batch makes short answers wait for long ones). Arrivals are grouped the way the batcher does (a
batch leaves when a worker slot is free and its first request has waited 20 ms); the static worker runs
one padded generate() batch at a time, the continuous worker hands several batches at once to the shared
continuous-batching engine. Without --model it builds the tests' tiny random Llama (seconds).
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(backend: Any, slots: int, rate: float, duration: float, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals: queue.SimpleQueue[tuple[float, str, int]] = queue.SimpleQueue()
    latencies: list[float] = []
    lock = threading.Lock()
    done = threading.Event()

    def generator() -> None:
        t, i = 0.0, 0
        start = time.monotonic()
        while t < duration:
            time.sleep(max(0.0, start + t - time.monotonic()))
            arrivals.put((time.monotonic(), f"the request {i} asks", rng.randint(4, 64)))
            i += 1
            t += rng.expovariate(rate)
        done.set()

    def worker() -> None:
        while not (done.is_set() and arrivals.empty()):
            try:
                first = arrivals.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            time.sleep(max(0.0, first[0] + 0.020 - time.monotonic()))  # the batcher's 20 ms wait
            while len(batch) < 100:
                try:
                    batch.append(arrivals.get_nowait())
                except queue.Empty:
                    break
            backend.run([b[1] for b in batch], [{"max_tokens": b[2], "temperature": 0} for b in batch])
            finished = time.monotonic()
            with lock:
                latencies.extend((finished - b[0]) * 1000 for b in batch)

    threads = [threading.Thread(target=generator)] + [threading.Thread(target=worker) for _ in range(slots)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    latencies.sort()
    return {"requests": len(latencies), "throughput_rps": round(len(latencies) / wall, 1),
            "p50_ms": round(latencies[len(latencies) // 2], 1),
            "p90_ms": round(latencies[int(len(latencies) * 0.9)], 1),
            "p99_ms": round(latencies[int(len(latencies) * 0.99)], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a causal LM folder or hub id (default: a tiny random Llama)")
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    path = args.model
    if path is None:
        from tests.models import build_tiny_llama

        path = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama"))
    static = HFCausalBackend("m", path, "cpu", 100, 64)
    continuous = HFCausalBackend("m", path, "cpu", 100, 64, continuous=EngineConfig(256, 32, 512, 64),
                                 slots=args.slots)
    try:
        report = {"rate_rps": args.rate, "duration_s": args.duration, "new_tokens": "4-64",
                  "static": measure(static, 1, args.rate, args.duration),
                  "continuous": measure(continuous, args.slots, args.rate, args.duration)}
    finally:
        continuous.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
