"""The service's own view of how fast it refused: ``llmb_request_duration_seconds{status="429"}`` from /metrics,
timed in the API processes from each request's arrival to its 429. A request arrives when its first byte reached
the host (the kernel's stamp), or at its connection's accept when that came later: time in the listen queue
before the accept is not counted.

A client on the same two cores as the service adds its own delay to every answer it times: sending 3,000 calls
at once, aiohttp spends 1.5 CPU-s before its last call is out and reads the refusals only when its loop gets
to them. The histogram tells the service's part apart; a benchmark reports both.

    before = scrape(url)
    ...  # the load
    print(refusals_since(before, scrape(url)))
"""
from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families

SERIES = "llmb_request_duration_seconds"


def scrape(url: str) -> dict[float, float]:
    """The 429 series's cumulative bucket counts now: upper bound (s) -> calls at or under it."""
    page = requests.get(f"{url}/metrics", timeout=30)
    page.raise_for_status()  # served elsewhere (LLMB_METRICS_BIND): no figures here to read
    text = page.text
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != SERIES:
            continue
        for sample in family.samples:
            if sample.name == f"{SERIES}_bucket" and sample.labels.get("status") == "429":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def refusals_since(before: dict[float, float], after: dict[float, float]) -> dict[str, float | int | None]:
    """The 429s between two scrapes: how many, the share timed within 20 ms and within 1 s of arrival (the
    targets of a steady overload and of a burst), and the bucket bound their p99 falls under (None: none)."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts.get(float("inf"), 0.0)

    def within(bound: float) -> float | None:
        return round(counts.get(bound, 0.0) / total, 4) if total else None

    p99 = next((bound for bound, n in counts.items() if total and n >= 0.99 * total), None)
    return {"count": int(total), "within_20ms": within(0.02), "within_1s": within(1.0), "p99_under_s": p99}
