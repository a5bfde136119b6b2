"""Prometheus metrics for the whole system, served by every API process at ``/metrics``.

Two kinds:

- per API process (requests by status, end-to-end latency): prometheus_client objects in multiprocess mode,
  so the numbers are right however many gunicorn workers serve them;
- system-wide (queue depth, oldest waiting request, workers by state, batch sizes and run times, poison and
  quarantine counts, dropped ledger records): read from Redis and RabbitMQ when scraped. Workers add each
  batch to Redis histograms in the same pipeline that writes its results, so a batch costs no extra round
  trip, and any API process can answer a scrape with the figures of every worker and batcher.
"""
from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import redis
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tasks.config import Settings
from tasks.policy.tenancy import TENANT_NAME
from tasks.schema import DRAINING, STARTING, WorkerInfo
from tasks.state.admission import Admission
from tasks.state.fleet import Fleet
from tasks.state.keys import Keys
from tasks.state.model_load import model_report
from tasks.state.quarantine import Quarantine

BATCH_SIZE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 80.0, 90.0, 95.0, 99.0, 100.0)
RUN_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# from 5 ms: a refusal's answer is judged against tens of milliseconds (the 429s of a steady overload)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)

HTTP_REQUESTS = Counter("llmb_http_requests", "Inference calls answered, by HTTP status and error type.",
                        ["status", "type"])
REQUEST_LATENCY = Histogram("llmb_request_duration_seconds", "End-to-end latency of inference calls.",
                            ["status"], buckets=LATENCY_BUCKETS)


# Refusals (429) by tenant, the tenant-fairness panel's signal. A tenant named by X-Tenant (keys off) is the
# caller's word, so the label values are bounded: past this many tenants in one process, the rest count as "other".
TENANT_REFUSALS = Counter("llmb_tenant_refusals", "Inference calls refused with 429, by tenant and error type.",
                          ["tenant", "type"])
MAX_TENANT_LABELS = 1000
_tenant_labels: set[str] = set()


def count_refusal(tenant: str, error_type: str) -> None:
    if not TENANT_NAME.fullmatch(tenant):  # refused before its name was checked: the caller's word is no label
        tenant = "invalid"
    if tenant not in _tenant_labels:
        if len(_tenant_labels) >= MAX_TENANT_LABELS:
            tenant = "other"
        else:
            _tenant_labels.add(tenant)
    TENANT_REFUSALS.labels(tenant, error_type).inc()


@functools.cache
def door_round_calls() -> Histogram:
    """Calls per admission round at the door (made on first use: an unlabelled metric in multiprocess mode opens
    its file when made, which must be in the API process, not in gunicorn's master)."""
    return Histogram("llmb_door_round_calls", "Calls per admission round at the door (each round is one admission "
                     "script call and one AMQP message): how far the door coalesces under load.",
                     buckets=(1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0))


def _bucket(value: float, bounds: tuple[float, ...]) -> str:
    i = bisect.bisect_left(bounds, value)
    return repr(bounds[i]) if i < len(bounds) else "+Inf"


COUNTERS = ("items_done", "batches_done", "poison_inputs", "ledger_dropped", "tokens")
# Items per LoRA adapter: adapters are registered by operators, so their names are bounded, but a label per name
# is still capped: the busiest this many adapters get their own series, the rest add up under "other".
MAX_ADAPTER_LABELS = 50


class Stats:
    """The system-wide counters and histograms in Redis that every process adds to and /metrics reads."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis) -> Stats:
        return cls(client, Keys.from_settings(settings))

    def add(self, counter: str, n: int = 1) -> None:
        self.client.incrby(self.keys.stat(counter), n)

    def counters(self) -> dict[str, int]:
        """Every counter in :data:`COUNTERS`, now."""
        return {n: int(v or 0) for n, v in zip(COUNTERS, self.client.mget([self.keys.stat(n) for n in COUNTERS]))}

    def count_adapters(self, items: Mapping[str, int]) -> None:
        """Items dispatched per LoRA adapter (the batcher, once their batch is handed to a worker)."""
        if items:
            pipe = self.client.pipeline(transaction=False)
            for name, n in items.items():
                pipe.hincrby(self.keys.stat("adapter_items"), name, n)
            pipe.execute()

    def adapter_items(self) -> dict[str, int]:
        raw: dict[bytes, bytes] = self.client.hgetall(self.keys.stat("adapter_items"))  # type: ignore[assignment]
        return {k.decode(): int(v) for k, v in raw.items()}

    def histogram(self, name: str) -> dict[bytes, bytes]:
        """One histogram as stored: bucket bound (or "sum") -> count."""
        return self.client.hgetall(self.keys.histogram(name))  # type: ignore[return-value]

    def busy_seconds(self) -> float:
        """Seconds the devices spent running batches, all of them together, since the system started."""
        return float(self.client.hget(self.keys.histogram("batch_run_seconds"), "sum") or 0)

    def observe_batch(self, pipe: Any, size: int, run_s: float, tokens: int = 0) -> None:
        """Add one batch to the histograms and token count (inside the caller's Redis pipeline)."""
        if tokens:
            pipe.incrby(self.keys.stat("tokens"), tokens)
        for name, value, bounds in (("batch_size", float(size), BATCH_SIZE_BUCKETS),
                                    ("batch_run_seconds", run_s, RUN_SECONDS_BUCKETS)):
            key = self.keys.histogram(name)
            pipe.hincrby(key, _bucket(value, bounds), 1)
            pipe.hincrbyfloat(key, "sum", value)


class SystemCollector(Collector):
    """System-wide figures, read at scrape time."""

    def __init__(self, settings: Settings, fleet: Fleet, admission: Admission,
                 queue_depth: Callable[[], int | None], clock: Callable[[], float] = time.time,
                 tenants: Callable[[], list[str]] = lambda: []) -> None:
        """``fleet``, ``admission`` and ``clock``: the API process's own (its gateway's), read at scrape time;
        ``tenants``: the tenants whose items in flight are reported."""
        self.settings = settings
        self.tenants = tenants
        self.clock = clock
        self.queue_depth = queue_depth
        self.fleet = fleet
        self.admission = admission
        self.stats = Stats.from_settings(settings, admission.client)
        self.quarantine = Quarantine.from_settings(settings, admission.client)

    def collect(self) -> Iterator[Metric]:
        s, now = self.settings, self.clock()
        try:
            # A scrape is rare (every 15 s or so): each figure is read from the object that owns it.
            in_flight, oldest = self.admission.in_flight(now), self.admission.oldest_arrival()
            counters, quarantined = self.stats.counters(), self.quarantine.count()
            sizes, runs = self.stats.histogram("batch_size"), self.stats.histogram("batch_run_seconds")
            adapter_items = self.stats.adapter_items()
            workers = self.fleet.all()
            live = [w for w in workers if now - w.heartbeat_at <= self.fleet.stale_after_s]
            models = model_report(self.admission, live, now, s.tenants.scale_headroom)
            names = sorted(set(self.tenants()) | {"default"})
            by_tenant = dict(zip(names, self.admission.tenants_in_flight(names, now)))
        except redis.RedisError:
            yield GaugeMetricFamily("llmb_redis_up", "Whether Redis answered this scrape.", value=0)
            return
        yield GaugeMetricFamily("llmb_redis_up", "Whether Redis answered this scrape.", value=1)
        depth = self.queue_depth()
        if depth is not None:
            yield GaugeMetricFamily("llmb_queue_depth", "Requests in RabbitMQ not yet taken by a batcher.",
                                    value=depth)
        yield GaugeMetricFamily("llmb_in_flight_items", "Items admitted and not yet answered.", value=in_flight)
        yield GaugeMetricFamily("llmb_oldest_waiting_seconds",
                                "Age of the oldest admitted, unanswered item (the autoscaling signal).",
                                value=now - oldest if oldest is not None else 0.0)
        yield from _per_model(models)
        by_state = GaugeMetricFamily("llmb_workers", "GPU workers by state, from heartbeats.", labels=["state"])
        states = {"idle": 0, "busy": 0, STARTING: 0, DRAINING: 0, "stale": 0}
        for w in workers:
            state = "stale" if now - w.heartbeat_at > self.fleet.stale_after_s else w.state
            states[state] = states.get(state, 0) + 1
        for state, n in states.items():
            by_state.add_metric([state], n)
        yield by_state
        yield from _prefix_caches([w for w in live if w.prefix_caching])
        yield from _adapters([w for w in live if w.max_adapters > 0], adapter_items)
        busy = GaugeMetricFamily("llmb_worker_utilisation", "Fraction of the last minute a live worker's device "
                                 "spent running batches.", labels=["worker", "model"])
        for w in live:
            busy.add_metric([w.id, w.model], w.utilisation)
        yield busy
        tenants = GaugeMetricFamily("llmb_tenant_in_flight", "A tenant's items admitted and not yet answered.",
                                    labels=["tenant"])
        for tenant, n in by_tenant.items():
            tenants.add_metric([tenant], n)
        yield tenants
        yield GaugeMetricFamily("llmb_deadline_budget_seconds", "The deadline of a call that sets none "
                                "(LLMB_DEFAULT_TIMEOUT_MS): queue ages are judged against it.",
                                value=s.admission.default_timeout_ms / 1000)
        done, batches, poison, dropped, tokens = (counters[n] for n in COUNTERS)
        yield CounterMetricFamily("llmb_tokens", "Prompt and generated tokens processed by every worker.",
                                  value=tokens)
        yield CounterMetricFamily("llmb_items_done", "Items answered with an output.", value=done)
        yield CounterMetricFamily("llmb_batches_done", "Batches run to completion.", value=batches)
        yield CounterMetricFamily("llmb_poison_inputs", "Inputs isolated as poison.", value=poison)
        yield GaugeMetricFamily("llmb_quarantined_inputs", "Inputs refused at the door now.", value=quarantined)
        yield CounterMetricFamily("llmb_ledger_records_dropped",
                                  "Ledger records dropped because the database was unreachable too long.",
                                  value=dropped)
        yield _histogram("llmb_batch_size", "Items per batch run.", sizes, BATCH_SIZE_BUCKETS)
        yield _histogram("llmb_batch_run_seconds", "Run time of each batch on its device.", runs,
                         RUN_SECONDS_BUCKETS)


def _prefix_caches(workers: list[WorkerInfo]) -> Iterator[Metric]:
    """Each live worker's prefix cache, from its heartbeat: hit rate = hits / queries (both count whole prompt
    pages since the worker started, so they reset with it, as counters do)."""
    labels = ["worker", "model"]
    queries = CounterMetricFamily("llmb_prefix_cache_queries", "Whole prompt pages a worker looked up in its prefix "
                                  "cache on admission.", labels=labels)
    hits = CounterMetricFamily("llmb_prefix_cache_hits", "Of those, pages found cached: not prefilled again.",
                               labels=labels)
    blocks = GaugeMetricFamily("llmb_prefix_cache_blocks", "Prompt pages a worker holds or caches now.",
                               labels=labels)
    for w in workers:
        queries.add_metric([w.id, w.model], w.prefix_queries)
        hits.add_metric([w.id, w.model], w.prefix_hits)
        blocks.add_metric([w.id, w.model], w.cached_blocks)
    yield from (queries, hits, blocks)


def _adapters(workers: list[WorkerInfo], items: Mapping[str, int]) -> Iterator[Metric]:
    """Each live worker's LoRA adapters, from its heartbeat (loads and evictions count since it started), and
    the items dispatched per adapter (the busiest :data:`MAX_ADAPTER_LABELS`, the rest as "other")."""
    labels = ["worker", "model"]
    resident = GaugeMetricFamily("llmb_worker_adapters_resident", "LoRA adapters resident on a worker now.",
                                 labels=labels)
    loading = GaugeMetricFamily("llmb_worker_adapters_loading", "LoRA adapters a worker is loading now.",
                                labels=labels)
    loads = CounterMetricFamily("llmb_worker_adapter_loads", "LoRA adapters a worker loaded.", labels=labels)
    evictions = CounterMetricFamily("llmb_worker_adapter_evictions", "LoRA adapters a worker evicted to make room.",
                                    labels=labels)
    for w in workers:
        resident.add_metric([w.id, w.model], len(w.adapters))
        loading.add_metric([w.id, w.model], len(w.adapters_loading))
        loads.add_metric([w.id, w.model], w.adapter_loads)
        evictions.add_metric([w.id, w.model], w.adapter_evictions)
    traffic = CounterMetricFamily("llmb_adapter_items", "Items dispatched to workers per LoRA adapter (the busiest "
                                  f"{MAX_ADAPTER_LABELS}; the rest as 'other').", labels=["adapter"])
    ranked = sorted(items.items(), key=lambda kv: (-kv[1], kv[0]))
    for name, n in ranked[:MAX_ADAPTER_LABELS]:
        traffic.add_metric([name], n)
    if len(ranked) > MAX_ADAPTER_LABELS:
        traffic.add_metric(["other"], sum(n for _, n in ranked[MAX_ADAPTER_LABELS:]))
    yield from (resident, loading, loads, evictions, traffic)


def _per_model(rows: list[dict[str, Any]]) -> Iterator[Metric]:
    """The autoscaling signal per model (see tasks.policy.capacity)."""
    oldest = GaugeMetricFamily("llmb_oldest_queued_seconds", "Age of the model's oldest admitted, unanswered "
                               "request: scale out when it grows past a few batch times.", labels=["model"])
    rate = GaugeMetricFamily("llmb_arrival_rate", "Items per second arriving for the model (last 10 s).",
                             labels=["model"])
    recommended = GaugeMetricFamily("llmb_recommended_workers", "Workers the model needs: arrival rate x batch "
                                    "time / batch size x headroom.", labels=["model"])
    live = GaugeMetricFamily("llmb_model_workers", "Live workers serving the model.", labels=["model"])
    for row in rows:
        oldest.add_metric([row["model"]], row["oldest_queued_s"])
        rate.add_metric([row["model"]], row["arrival_rate_per_s"])
        live.add_metric([row["model"]], row["workers"])
        if row["recommended_workers"] is not None:
            recommended.add_metric([row["model"]], row["recommended_workers"])
    yield from (oldest, rate, recommended, live)


def _histogram(name: str, doc: str, raw: dict[bytes, bytes], bounds: tuple[float, ...]) -> Metric:
    counts = {k.decode(): float(v) for k, v in raw.items()}
    cumulative, buckets = 0.0, []
    for label in [repr(b) for b in bounds] + ["+Inf"]:
        cumulative += counts.get(label, 0.0)
        buckets.append((label, cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=counts.get("sum", 0.0))
