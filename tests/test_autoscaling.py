"""Autoscaling, tested on a real stack: the signal the ScaledObjects in deploy/kubernetes scale on, per model.

Two models on sim workers: "busy" (a small device: 10 items per 250 ms batch, 40 items/s) and "calm". Load above
the busy model's capacity makes its ``llmb_oldest_queued_seconds`` rise past the ScaledObject's threshold within
seconds, while the calm model's stays near zero; once the load stops and its backlog drains, it falls back. What
KEDA would do with those readings (each trigger's threshold read out of the rendered ScaledObject: replicas =
ceil(value / threshold), the larger trigger wins) scales the busy model out, and agrees with the recommended
worker count `llmb-admin stats` prints.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from harness.helpers import expected
from harness.kube import OVERLAYS, Obj, keda_replicas, named, render, trigger
from harness.stack import Stack, running_stack, wait_for

AGE, RECOMMENDED = "llmb_oldest_queued_seconds", "llmb_recommended_workers"
BUSY_DEVICE = {"sim_batch_ms": 250, "sim_max_batch": 10}  # 40 items/s
LOAD_ITEMS_PER_S = 100  # two and a half times that
LOAD_S = 6.0
CALL_INPUTS = 10


@pytest.fixture(scope="module")
def scaled_object() -> Obj:
    """The generative model's ScaledObject in the base, as KEDA would get it."""
    return named(render(OVERLAYS["base"]), "ScaledObject", "llmb-worker-lm")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("autoscaling"))
    with running_stack(tmp, workers=[(0, {"model": "busy", **BUSY_DEVICE}), (1, {"model": "calm"})],
                       web_workers=1) as s:
        yield s


def signal(stack: Stack) -> dict[str, dict[str, float]]:
    """Per model, the autoscaling series on /metrics (what Prometheus scrapes for KEDA)."""
    text = requests.get(stack.url + "/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (AGE, RECOMMENDED):
                out.setdefault(s.labels["model"], {})[s.name] = s.value
    return out


def stats(stack: Stack) -> dict[str, dict[str, object]]:
    report = json.loads(stack.admin("stats", "--json", "--interval", "0.1").stdout)
    return {m["model"]: m for m in report["models"]}


def load(url: str, model: str, stop: threading.Event, pool: ThreadPoolExecutor, duration_s: float
         ) -> list[Future[requests.Response]]:
    """Open-loop load on ``model``: CALL_INPUTS-item calls at LOAD_ITEMS_PER_S, for ``duration_s`` or until
    ``stop``; the calls' futures."""
    sessions = threading.local()

    def call(i: int) -> requests.Response:
        if not hasattr(sessions, "s"):
            sessions.s = requests.Session()  # one pooled client per thread, no retries
        body = {"model": model, "inputs": [f"{model} {i} {k}" for k in range(CALL_INPUTS)], "timeout_ms": 60_000}
        return sessions.s.post(url + "/v1/infer", json=body, timeout=90)

    futures, start, i = [], time.monotonic(), 0
    while not stop.is_set() and time.monotonic() < start + duration_s:
        due = start + i * CALL_INPUTS / LOAD_ITEMS_PER_S
        if time.monotonic() >= due:
            futures.append(pool.submit(call, i))
            i += 1
        else:
            stop.wait(max(0.0, due - time.monotonic()))
    return futures


def test_queue_age_scales_the_busy_model_alone(stack: Stack, scaled_object: Obj) -> None:
    threshold = float(trigger(scaled_object, AGE)["metadata"]["threshold"])
    lo = int(scaled_object["spec"]["minReplicaCount"])
    idle = signal(stack)
    assert set(idle) == {"busy", "calm"} and idle["busy"][AGE] < threshold, idle

    stop, calm_ages = threading.Event(), []
    with ThreadPoolExecutor(max_workers=64) as pool:
        loader = pool.submit(load, stack.url, "busy", stop, pool, LOAD_S)
        calm = requests.Session()

        def backlog_seen() -> dict[str, dict[str, float]] | None:
            reading = signal(stack)
            calm_ages.append(reading["calm"][AGE])
            r = calm.post(stack.url + "/v1/infer", json={"model": "calm", "input": "steady"}, timeout=30)
            assert r.status_code == 200 and r.json()["output"] == expected("steady"), r.text
            return reading if reading["busy"][AGE] >= threshold else None

        # the age rises past the trigger's threshold within seconds of the backlog
        reading = wait_for(backlog_seen, LOAD_S, f"{AGE}{{model=busy}} past {threshold:g} s under load")
        busy = reading["busy"]
        wanted = keda_replicas(scaled_object, busy)
        assert wanted > lo and wanted >= busy.get(RECOMMENDED, 0), (busy, wanted)
        answers = [f.result(timeout=120) for f in loader.result()]  # the load ran its course
        assert max(calm_ages) < 1.0, f"the calm model's age moved with the other's backlog: {calm_ages}"
    assert answers and all(r.status_code == 200 for r in answers), {r.status_code for r in answers}

    # the backlog cleared: the age falls back, and KEDA would keep only what the arrival rate needs
    def cleared() -> dict[str, dict[str, float]] | None:
        reading = signal(stack)
        calm_ages.append(reading["calm"][AGE])
        return reading if reading["busy"][AGE] < 1.0 else None

    after = wait_for(cleared, 30, f"{AGE}{{model=busy}} back under 1 s")
    assert max(calm_ages) < 1.0, calm_ages
    assert keda_replicas(scaled_object, {RECOMMENDED: after["busy"].get(RECOMMENDED, 0)}) == \
        keda_replicas(scaled_object, after["busy"])


def test_stats_recommendation_is_what_keda_would_run(stack: Stack, scaled_object: Obj) -> None:
    """`llmb-admin stats`' recommended workers for a model equal the replicas KEDA's recommended-workers trigger asks
    for from the same series on /metrics: ceil(value / threshold), its threshold read from the ScaledObject (so a
    threshold changed in the manifest that broke the one-replica-per-recommended-worker reading fails here)."""
    rec = trigger(scaled_object, RECOMMENDED)
    threshold = float(rec["metadata"]["threshold"])
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=64) as pool:
        loader = pool.submit(load, stack.url, "busy", stop, pool, 20.0)

        def agree() -> tuple[int, int] | None:
            from_stats = stats(stack)["busy"]["recommended_workers"]
            scraped = signal(stack)["busy"].get(RECOMMENDED)
            if from_stats is None or scraped is None:
                return None
            keda = -(-scraped // threshold)  # ceil
            return (int(keda), int(str(from_stats))) if keda == from_stats and int(keda) > 1 else None

        try:
            keda, recommended = wait_for(agree, 15, "stats and KEDA agreeing on more than one worker under load")
        finally:
            stop.set()
        for f in loader.result():
            f.result(timeout=120)
    assert keda == recommended > 1
