"""Static batches against continuous batching for generation, in process, with requests arriving over time.

    python -m bench.generation [--model PATH] [--rate 50] [--duration 5]
    python -m bench.generation --burst [--n 80] [--short 8] [--long 200]   # sampled vs greedy, one burst

Requests arrive as a Poisson process and ask for 4 to 64 new tokens (mixed lengths: the case where a
padded batch makes short answers wait for long ones). Arrivals are grouped the way the batcher does (a
batch leaves when a worker slot is free and its first request has waited 20 ms); the static worker runs
one padded generate() batch at a time, the continuous worker hands several batches at once to the shared
continuous-batching engine. Without --model it builds the tests' tiny random Llama (seconds).

``--burst``: ``--n`` requests arrive at once and run as the one batch the batcher forms of them, half asking for
``--short`` new tokens and half for ``--long``, every one streamed, sampled (temperature 0.8, top_p 0.95, a
distinct seed each) or greedy, on each engine: the continuous engine (sampled rows through the seeded sampler)
and static ``generate()`` (one padded batch, or one per seed when sampled). For each half: the median time of
its first and last streamed token (what a streaming client sees), the time ``run()`` took for the whole batch,
and the process's CPU seconds over it.
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness.stats import percentile, rounded
from tasks.schema import SamplingParams


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
            backend.run([b[1] for b in batch], [SamplingParams(max_tokens=b[2], temperature=0) for b in batch])
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
    return {"requests": len(latencies), "throughput_rps": round(len(latencies) / wall, 1),
            **{f"p{q}_ms": rounded(percentile(latencies, q)) for q in (50, 90, 99)}}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def burst(backend: Any, n: int = 80, short: int = 8, long: int = 200, *, sampled: bool) -> dict[str, Any]:
    """``n`` streamed requests handed to ``backend`` as one batch (half ``short``, half ``long`` new tokens):
    per half, the median time of the first and the last streamed token and of the answer (``run()`` returning),
    and the tokens generated (a random model may say EOS early)."""
    from gpu_worker.backends.interface import Hooks

    inputs = [f"the request {i} asks" for i in range(n)]
    params = [SamplingParams(max_tokens=short if i % 2 == 0 else long, temperature=0.8, top_p=0.95, seed=1000 + i)
              if sampled else SamplingParams(max_tokens=short if i % 2 == 0 else long, temperature=0)
              for i in range(n)]
    first: dict[int, float] = {}
    last: dict[int, float] = {}

    def stream(deltas: list[tuple[int, str]]) -> None:
        now = time.monotonic()
        for index, _ in deltas:
            first.setdefault(index, now)
            last[index] = now

    started, cpu = time.monotonic(), time.process_time()
    outputs = backend.run(inputs, params, Hooks(streaming=set(range(n)), stream=stream))
    answered = (time.monotonic() - started) * 1000
    report: dict[str, Any] = {"batch_ms": round(answered, 1), "cpu_s": round(time.process_time() - cpu, 2)}
    for name, parity in (("short", 0), ("long", 1)):
        rows = [i for i in range(n) if i % 2 == parity]
        report[name] = {
            "max_tokens": short if parity == 0 else long,
            "mean_tokens": round(statistics.mean(outputs[i].completion_tokens for i in rows), 1),
            "first_token_p50_ms": _median([(first[i] - started) * 1000 for i in rows if i in first]),
            "last_token_p50_ms": _median([(last[i] - started) * 1000 for i in rows if i in last]),
            "answered_p50_ms": round(answered, 1)}
    return report


def run_burst(path: str, args: argparse.Namespace) -> dict[str, Any]:
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    continuous = HFCausalBackend("m", path, "cpu", 100, 1024, continuous=EngineConfig(256, 32, 512, 64),
                                 slots=args.slots)
    try:
        report = {"n": args.n, "short": args.short, "long": args.long,
                  "sampled, continuous engine (seeded sampler)":
                      burst(continuous, args.n, args.short, args.long, sampled=True),
                  "greedy, continuous engine": burst(continuous, args.n, args.short, args.long, sampled=False)}
    finally:
        continuous.close()
    static = HFCausalBackend("m", path, "cpu", 100, 1024)
    report["sampled, static (one padded generate() per seed)"] = burst(static, args.n, args.short, args.long,
                                                                       sampled=True)
    report["greedy, static (one padded generate())"] = burst(static, args.n, args.short, args.long, sampled=False)
    return report


def burst_table(report: dict[str, Any]) -> str:
    lines = [f"{report['n']} requests at once, one batch; half max_tokens {report['short']}, half {report['long']}; "
             "medians in ms from the batch's start", "",
             "| path | short: first / last token | long: first / last token | answered (whole batch) | CPU s | "
             "tokens short / long |",
             "|---|---|---|---|---|---|"]
    for name, r in report.items():
        if isinstance(r, dict):
            short, long = r["short"], r["long"]
            lines.append(f"| {name} | {short['first_token_p50_ms']} / {short['last_token_p50_ms']} | "
                         f"{long['first_token_p50_ms']} / {long['last_token_p50_ms']} | {r['batch_ms']} | "
                         f"{r['cpu_s']} | {short['mean_tokens']} / {long['mean_tokens']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a causal LM folder or hub id (default: a tiny random Llama)")
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--burst", action="store_true", help="sampled vs greedy requests, all at once (see above)")
    ap.add_argument("--n", type=int, default=80, help="--burst: requests")
    ap.add_argument("--short", type=int, default=8, help="--burst: max_tokens of half of them")
    ap.add_argument("--long", type=int, default=200, help="--burst: max_tokens of the other half")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    path = args.model
    if path is None:
        from harness.models import build_tiny_llama

        path = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama"))
    if args.burst:
        report = run_burst(path, args)
        print(json.dumps(report, indent=2))
        print(burst_table(report))
        return
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
