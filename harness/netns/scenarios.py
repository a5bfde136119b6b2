"""The multi-host scenarios, run by tests/test_hosts.py (which asserts) and bench/hosts.py (which prints): a cable
pulled under load from a GPU host, the active batcher's host or an API host, and one tenant's flood beside
another's steady calls; each returns what happened as callers and the system saw it."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from harness.helpers import decoded, scored
from harness.loadgen import LoadReport, carry_on, report_of, warm
from harness.netns.hosts import Hosts
from harness.netns.sampler import OutstandingSampler
from harness.stack import wait_for


def outcome_counts(report: LoadReport, timeout_ms: float) -> dict[str, Any]:
    """What the closing note cites: sent, answers by status, connection errors by kind, answered twice (one
    request accounted for more than once), and the longest wait past the deadline."""
    seqs = [o.seq for o in report.outcomes]
    past = [o.latency_ms - timeout_ms for o in report.outcomes]
    return {
        "sent": report.sent, **{str(s): report.statuses.get(s, 0) for s in (200, 429, 503, 504)},
        "other": {s: n for s, n in report.statuses.items() if s not in (0, 200, 429, 503, 504)},
        "conn_errors": dict(report.no_answer_kinds), "wrong_output": report.wrong_output,
        "answered_twice": len(seqs) - len(set(seqs)), "late": report.late,
        "max_past_deadline_ms": round(max(past, default=0.0), 1),
        "p50_ms": round(report.p(50), 1), "p99_ms": round(report.p(99), 1),
    }


@dataclass
class GpuCut:
    report: LoadReport
    left_pool_s: float  # cut -> its heartbeat stale (out of the batchers' pool)
    rejoined_s: float  # restore -> a fresh heartbeat again
    ran_again_s: float  # restore -> it finished new batches (consuming its queue again)
    taken_back: bool  # a batcher logged taking its batches back
    skipped_late: int  # batches it skipped on waking (reassigned meanwhile), from its log
    outstanding: dict[str, int]
    timeout_ms: int


def gpu_cut(h: Hosts, host: str = "gpu1", rate: float = 40, timeout_ms: int = 10_000, cut_s: float = 4.0) -> GpuCut:
    """Cut a GPU host's link while it runs a batch under load, keep it cut ``cut_s`` s past the moment it
    leaves the pool, restore it, and wait for it to serve again."""
    wid, logs_before = h.worker_id(host), {b: len(h.log(b)) for b in h.batcher_hosts}
    skipped_before = h.log(host).count("was reassigned")
    with OutstandingSampler(h) as sampler:
        load = h.load("api", rate, timeout_ms=timeout_ms, prefix=f"cut-{host}")
        try:
            warm(load)
            wait_for(lambda: h.fleet().get(wid, {}).get("state") == "busy", 15, f"{wid} running a batch")
            cut_at = h.cut(host)
            wait_for(lambda: not h.fresh(host), 15, f"{wid} to leave the pool (stale heartbeat)")
            left = time.monotonic() - cut_at
            carry_on(load, cut_s)
            restored_at = h.restore(host)
            # Each wait reads the fleet once per check and goes on from what that reading said: the worker's entry
            # may be gone again from the next reading (Hosts.beat says why), so none is read twice as if it stayed.
            back = wait_for(lambda: h.beat(host), 30, f"{wid} heartbeating again")
            rejoined = time.monotonic() - restored_at
            done0 = int(back.get("completed") or 0)
            wait_for(lambda: int(h.fleet().get(wid, {}).get("completed") or 0) >= done0 + 3
                     and h.queue(h.gpu_queue(host))[1] >= 1, 30, f"{wid} running new batches")
            ran_again = time.monotonic() - restored_at
            carry_on(load, 2)
        finally:
            report = load.stop()
    taken = any("is lost" in h.log(b)[logs_before[b]:] and wid in h.log(b)[logs_before[b]:] for b in h.batcher_hosts)
    return GpuCut(report, left, rejoined, ran_again, taken, h.log(host).count("was reassigned") - skipped_before,
                  dict(sampler.max_outstanding), timeout_ms)


@dataclass
class BatcherCut:
    report: LoadReport
    active: str
    standby: str
    heartbeat_s: str  # the negotiated AMQP heartbeat of the active batcher's connections, from RabbitMQ
    switched_s: float | None  # cut -> RabbitMQ dropped the active consumer (the standby gets the requests)
    first_answer_s: float | None  # cut -> first 200 to a request sent after the cut
    worst_after_cut_ms: float  # the longest latency of a request sent in the first second after the cut
    rejoined_s: float | None  # restore -> the cut batcher consuming again (as the standby)
    active_after: str | None
    outstanding: dict[str, int]
    timeout_ms: int
    outstanding_at: dict[str, float] = field(default_factory=dict)  # when each maximum was seen (s after the cut)


def batcher_cut(h: Hosts, rate: float = 40, timeout_ms: int = 10_000, switch_within_s: float = 30) -> BatcherCut:
    """Cut the active batcher's host under load; the standby must take over; restore it (it becomes the
    standby). ``switched_s`` is None when RabbitMQ still counted the cut consumer after ``switch_within_s``."""
    active = h.active_batcher()
    if active is None:
        raise RuntimeError("no active consumer on the request queue")
    standby = next(b for b in h.batcher_hosts if b != active)
    beats = sorted({c["heartbeat_s"] for c in h.connections() if c["host"] == active})
    switched = first = rejoined = None
    with OutstandingSampler(h) as sampler:
        load = h.load("api", rate, timeout_ms=timeout_ms, prefix="cut-batcher")
        try:
            warm(load)
            cut_at = h.cut(active)
            try:
                wait_for(lambda: h.queue(h.request_queue)[1] == len(h.batcher_hosts) - 1, switch_within_s,
                         f"RabbitMQ to drop {active}'s consumer")
                switched = time.monotonic() - cut_at
            except TimeoutError:
                pass
            carry_on(load, 3)
            restored_at = h.restore(active)
            try:
                wait_for(lambda: h.queue(h.request_queue)[1] == len(h.batcher_hosts), 45,
                         f"{active} consuming again")
                rejoined = time.monotonic() - restored_at
            except TimeoutError:
                pass
            carry_on(load, 1)
        finally:
            report = load.stop()
    after = [o for o in report.outcomes if o.sent_at >= cut_at]
    answers = [o.sent_at + o.latency_ms / 1000 - cut_at for o in after if o.status == 200]
    first = min(answers) if answers else None
    worst = max((o.latency_ms for o in after if o.sent_at < cut_at + 1.0), default=0.0)
    offset = cut_at - sampler.started_at
    return BatcherCut(report, active, standby, ",".join(beats), switched, first, worst, rejoined,
                      h.active_batcher(), dict(sampler.max_outstanding), timeout_ms,
                      {k: round(v - offset, 2) for k, v in sampler.max_at.items()})


@dataclass
class ApiCut:
    victim: str
    report: LoadReport  # the callers of the cut host
    other: LoadReport | None  # the callers of the host beside it, if any
    held_at_cut: int  # items the cut host's processes had admitted when its cable was pulled
    released_s: float | None  # cut -> none of those items still counted in admission (None: not within the wait)
    still_held: int  # those of them still counted at the end of the wait
    reaped_instances: int  # the cut host's leases removed by another API process
    resumed_s: float  # restore -> a new call through the cut host answered 200
    inflight_after: int  # admission once the loads are over and answered
    timeout_ms: int
    leftover: list[tuple[str, float, str | None]] = field(default_factory=list)  # (item, s to its deadline, owner)


def api_cut(h: Hosts, victim: str = "api", beside: str | None = None, rate: float = 40, timeout_ms: int = 30_000,
            other_timeout_ms: int = 10_000, release_within_s: float | None = None) -> ApiCut:
    """Cut an API host with callers in flight (their deadlines far off, so expiry cannot explain a release),
    wait up to ``release_within_s`` (default: the lease + 3 s) for what it admitted to be released, restore it,
    and check a new call through it succeeds. ``beside``: another API host under its own load meanwhile.

    The cut host's processes are told apart by their leases: from the cut on, theirs are never renewed (the
    score stays what it was, until another process reaps it), everyone else's moves on every lease / 3."""
    lease = float(h.env.get("LLMB_API_LEASE_S", 5.0))
    within = lease + 3 if release_within_s is None else release_within_s
    ns = h.namespace
    load = h.load(victim, rate, timeout_ms=timeout_ms, prefix=f"cut-{victim}")
    other = h.load(beside, rate / 2, timeout_ms=other_timeout_ms, prefix=f"beside-{beside}") if beside else None
    try:
        warm(load)
        if other is not None:
            warm(other, 10)
        wait_for(lambda: h.inflight() > 0, 10, "items in flight")
        cut_at = h.cut(victim)

        def leases_and_owners(r: redis.Redis) -> dict[str, tuple[float, list[str]]]:
            return {m: (score, [decoded(k) for k in r.hkeys(f"{ns}:inflight:owner:{m}")])
                    for m, score in scored(r.zrange(f"{ns}:inflight:instances", 0, -1, withscores=True))}

        snapshot = h.redis(leases_and_owners)  # the cut processes can change nothing of theirs from now on

        def held() -> tuple[int, int, int]:
            """(items the cut host's processes had admitted at the cut, those still admitted, their leases
            reaped)."""
            def read(r: redis.Redis) -> tuple[int, int, int]:
                live = dict(scored(r.zrange(f"{ns}:inflight:instances", 0, -1, withscores=True)))
                victims = [i for i in snapshot if i not in live or live[i] == snapshot[i][0]]
                ids = [x for i in victims for x in snapshot[i][1]]
                still = sum(1 for s in (r.zmscore(f"{ns}:inflight", ids) if ids else []) if s is not None)
                return len(ids), still, sum(1 for i in victims if i not in live)
            return h.redis(read)

        released = None
        try:
            def none_held() -> bool:
                if time.monotonic() - cut_at < lease / 3 + 0.5:  # until the others have renewed, all look cut
                    return False
                _, still, reaped = held()
                return still == 0 and (beside is None or reaped >= h.web_workers)
            wait_for(none_held, within, f"what {victim} admitted to be released")
            released = time.monotonic() - cut_at
        except TimeoutError:
            pass
        held_at_cut, still, reaped = held()
        restored_at = h.restore(victim)
        wait_for(lambda: h.serves(victim, timeout=5), 30, f"{victim} serving again")
        resumed = time.monotonic() - restored_at
    finally:
        h.restore_all()
        report = load.stop()
        other_report = other.stop() if other is not None else None
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: h.inflight() == 0, 10, "admission to empty after the loads")
    return ApiCut(victim, report, other_report, held_at_cut, released, still, reaped, resumed, h.inflight(),
                  timeout_ms, h.redis(lambda r: admitted_items(r, ns)))


def admitted_items(r: redis.Redis, ns: str) -> list[tuple[str, float, str | None]]:
    """Every item in the admission set: (id, seconds to its deadline on Redis's clock, the API process
    instance whose owner hash holds it, if any)."""
    sec, usec = r.time()
    now = sec + usec / 1e6
    owners = [decoded(k) for k in r.scan_iter(f"{ns}:inflight:owner:*")]
    out = []
    for member, score in scored(r.zrange(f"{ns}:inflight", 0, -1, withscores=True)):
        owner = next((o.rsplit(":", 1)[1] for o in owners if r.hexists(o, member)), None)
        out.append((member, round(score - now, 1), owner))
    return out


@dataclass
class Fairness:
    batchers: int
    steady: LoadReport  # the steady tenant's requests sent while the flood was on
    steady_all: LoadReport
    flood: LoadReport
    flood_items: int
    flood_s: float  # first flood call sent -> last flood call answered
    outstanding: dict[str, int]
    max_ready: dict[str, int]


def fairness(h: Hosts, steady_rate: float = 10, flood_calls_per_s: float = 25, flood_inputs: int = 40,
             flood_calls: int = 100, steady_timeout_ms: int = 10_000, flood_timeout_ms: int = 15_000) -> Fairness:
    """A steady tenant beside another tenant's flood (``flood_calls`` calls of ``flood_inputs`` items at
    ``flood_calls_per_s``) with the batchers now running; the most batches outstanding on each worker."""
    with OutstandingSampler(h) as sampler:
        steady = h.load("api", steady_rate, timeout_ms=steady_timeout_ms, tenant="steady", prefix="steady")
        try:
            warm(steady, 10)
            flood = h.load("api", flood_calls_per_s, timeout_ms=flood_timeout_ms, tenant="flood",
                           inputs_per_call=flood_inputs, prefix="flood", max_workers=256)
            flood_start = time.monotonic()
            try:
                wait_for(lambda: flood.sent >= flood_calls, flood_calls / flood_calls_per_s + 30,
                         f"{flood_calls} flood calls sent")
            finally:
                flood_report = flood.stop()
            flood_end = max((o.sent_at + o.latency_ms / 1000 for o in flood_report.outcomes), default=flood_start)
            carry_on(steady, 1)
        finally:
            steady_report = steady.stop()
    during = [o for o in steady_report.outcomes if flood_start <= o.sent_at <= flood_end]
    return Fairness(len(h.batcher_hosts) - sum(1 for b in h.batcher_hosts if not h.running(b)),
                    report_of(during, flood_end - flood_start), steady_report, flood_report,
                    flood_report.sent * flood_inputs, flood_end - flood_start, dict(sampler.max_outstanding),
                    dict(sampler.max_ready))
