"""Open-loop load generator: Poisson arrivals at a fixed rate for a bounded time, one process (gevent).

    python bench/load.py --url http://127.0.0.1:8000 --rate 300 --duration 20

Arrivals are scheduled ahead of time and sent whether or not earlier requests have returned (open loop), so
a slow server cannot slow the offered load down. The generator reports its own scheduling lag: if that is
large, the figures measure the generator, not the system.
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import collections  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import gevent  # noqa: E402
from gevent.pool import Pool  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rate", type=float, required=True, help="offered requests per second")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    ap.add_argument("--timeout-ms", type=int, default=5000, help="per-request deadline sent to the server")
    ap.add_argument("--concurrency", type=int, default=5000, help="most requests in flight")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    target = urlparse(args.url)
    rng = random.Random(args.seed)
    latencies: list[float] = []
    late_ms: list[float] = []
    lags: list[float] = []
    statuses: collections.Counter[int | str] = collections.Counter()
    batch_sizes: collections.Counter[int] = collections.Counter()
    pool = Pool(args.concurrency)

    def one(i: int) -> None:
        body = json.dumps({"input": f"bench {args.seed} {i}", "timeout_ms": args.timeout_ms})
        started = time.monotonic()
        try:
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=args.timeout_ms / 1000 + 10)
            conn.request("POST", "/v1/infer", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            statuses[resp.status] += 1
        except OSError as exc:
            statuses[type(exc).__name__] += 1
            return
        elapsed = (time.monotonic() - started) * 1000
        late_ms.append(elapsed - args.timeout_ms)
        if resp.status == 200:
            latencies.append(elapsed)
            batch_sizes[json.loads(data)["batch"]["size"]] += 1

    t0 = time.monotonic()
    next_at = 0.0
    sent = 0
    while next_at < args.duration:
        delay = t0 + next_at - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        lags.append(max(0.0, time.monotonic() - (t0 + next_at)) * 1000)
        pool.spawn(one, sent)
        sent += 1
        next_at += rng.expovariate(args.rate)
    pool.join()
    wall = time.monotonic() - t0
    ok = statuses.get(200, 0)
    sizes = [s for s, n in batch_sizes.items() for _ in range(n)]
    print(json.dumps({
        "offered_rps": args.rate, "sent": sent, "duration_s": round(wall, 2),
        "goodput_rps": round(ok / args.duration, 1), "statuses": {str(k): v for k, v in statuses.items()},
        "latency_ms": {q: round(percentile(latencies, float(q[1:])), 1) for q in ("p50", "p90", "p99")},
        "mean_batch_size_seen_by_requests": round(sum(sizes) / len(sizes), 1) if sizes else None,
        "answered_after_deadline_plus_100ms": sum(1 for x in late_ms if x > 100),
        "generator_lag_ms": {"p50": round(percentile(lags, 50), 2), "p99": round(percentile(lags, 99), 2)},
    }, indent=2))


if __name__ == "__main__":
    main()
