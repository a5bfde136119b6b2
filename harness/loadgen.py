"""A steady open-loop load generator for fault tests and the benchmark's fault table (plain threads, `requests`).

    load = SteadyLoad(stack.url, 40, timeout_ms=10_000).start()
    ...                                  # inject a fault while the load runs
    report = load.stop()                 # stop sending, wait for every outstanding request
    report.assert_sound()

Arrivals are evenly spaced at ``rate_per_s`` and sent whether or not earlier requests have returned (open loop;
a pool of ``max_workers`` threads carries them, so a stalled server cannot slow the offered load down until
that many requests are outstanding at once). Every request is accounted for exactly once: by its HTTP status,
or by status 0 when no HTTP answer came (connection refused or reset, or the client's own timeout, which is
the deadline + 5 s, so a hang shows up as a late non-answer rather than blocking the test).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import requests

from harness.helpers import expected
from harness.stack import wait_for
from harness.stats import percentile

LATE_SLACK_S = 1.0  # an answer more than this after the request's deadline is late
CLIENT_SLACK_S = 5.0  # the client gives up this long after the deadline (status 0, late)


@dataclasses.dataclass
class Outcome:
    """One request, as its caller saw it."""
    seq: int
    sent_at: float  # time.monotonic() when the request left
    status: int  # 0: no HTTP answer
    latency_ms: float
    late: bool
    error_type: str | None = None  # error.type of a JSON error body
    error_message: str | None = None
    no_answer: str | None = None  # why, when status is 0: refused, reset, timeout or an exception's class
    non_json: bool = False  # an error answer whose body is not the service's JSON error shape
    wrong_output: bool = False  # a 200 whose output is not this request's own


@dataclasses.dataclass
class LoadReport:
    sent: int
    statuses: collections.Counter[int]
    error_types: collections.Counter[str]
    wrong_output: int
    late: int
    latencies_ms: list[float]
    non_json: int = 0
    no_answer_kinds: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    duration_s: float = 0.0
    error_examples: dict[str, str] = dataclasses.field(default_factory=dict)  # error.type -> its first message
    error_messages: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # "type: msg"
    outcomes: list[Outcome] = dataclasses.field(default_factory=list, repr=False)

    @property
    def no_answer(self) -> int:
        return self.statuses.get(0, 0)

    def count(self, lo: int, hi: int) -> int:
        """Answers with lo <= status <= hi."""
        return sum(n for s, n in self.statuses.items() if lo <= s <= hi)

    def p(self, q: float) -> float:
        """The q-th percentile (0-100) of the latency of every answer (any status), in ms; nan when none."""
        value = percentile(self.latencies_ms, q)
        return float("nan") if value is None else value

    def summary(self) -> str:
        statuses = " ".join(f"{s}:{n}" for s, n in sorted(self.statuses.items()))
        errors = " ".join(f"{t}:{n}" for t, n in sorted(self.error_types.items())) or "-"
        kinds = " ".join(f"{t}:{n}" for t, n in sorted(self.no_answer_kinds.items()))
        return (f"sent {self.sent} in {self.duration_s:.1f}s | statuses {statuses or '-'} | errors {errors} | "
                f"no answer {self.no_answer}{f' ({kinds})' if kinds else ''} | wrong output {self.wrong_output} | "
                f"late {self.late} | non-JSON {self.non_json} | p50 {self.p(50):.0f} ms p99 {self.p(99):.0f} ms "
                f"max {max(self.latencies_ms, default=0):.0f} ms")

    def assert_sound(self, *, allow: set[int] | frozenset[int] = frozenset({200}), max_no_answer: int = 0) -> None:
        """Every request answered once, with its own output or an allowed status, in time and as JSON."""
        problems = []
        if self.sent != sum(self.statuses.values()):
            problems.append(f"{self.sent} sent but {sum(self.statuses.values())} accounted for")
        if self.sent == 0:
            problems.append("nothing was sent")
        if self.wrong_output:
            problems.append(f"{self.wrong_output} answer(s) with someone else's output")
        if self.late:
            problems.append(f"{self.late} answer(s) later than deadline + {LATE_SLACK_S:g} s")
        if self.no_answer > max_no_answer:
            problems.append(f"{self.no_answer} request(s) with no HTTP answer (at most {max_no_answer} allowed)")
        if self.non_json:
            problems.append(f"{self.non_json} error answer(s) that are not the JSON error shape")
        bad = {s: n for s, n in self.statuses.items() if s != 0 and s not in allow}
        if bad:
            problems.append(f"statuses outside {sorted(allow)}: {bad}")
        if problems:
            raise AssertionError("; ".join(problems) + "\n" + self.summary())


class SteadyLoad:
    def __init__(self, url: str, rate_per_s: float, *, timeout_ms: int = 10_000, tenant: str | None = None,
                 prefix: str = "load", inputs_per_call: int = 1, max_workers: int = 128,
                 headers: dict[str, str] | None = None, body: Callable[[int], dict[str, Any]] | None = None) -> None:
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")
        self.url = url.rstrip("/") + "/v1/infer"
        self.rate = rate_per_s
        self.timeout_ms = timeout_ms
        self.tenant = tenant
        self.prefix = prefix
        self.inputs_per_call = inputs_per_call
        self.headers = dict(headers or {})
        self.body = body
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="steady-load")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._futures: list[Future[Outcome]] = []
        self._lock = threading.Lock()
        self._started_at = 0.0
        self._stopped_at = 0.0

    # -- the load ----------------------------------------------------------------------------------------
    def start(self) -> SteadyLoad:
        if self._thread is not None:
            raise RuntimeError("already started")
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._arrivals, name="steady-load-arrivals", daemon=True)
        self._thread.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def sent(self) -> int:
        with self._lock:
            return len(self._futures)

    def answered(self) -> int:
        """Requests finished so far (any outcome)."""
        with self._lock:
            return sum(1 for f in self._futures if f.done())

    def _arrivals(self) -> None:
        interval, seq = 1.0 / self.rate, 0
        while not self._stop.is_set():
            due = self._started_at + seq * interval
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            future = self._pool.submit(self._one, seq)
            with self._lock:
                self._futures.append(future)
            seq += 1

    def retarget(self, url: str) -> None:
        """Send the requests from now on to ``url`` (a load balancer moving to another API host)."""
        self.url = url.rstrip("/") + "/v1/infer"

    def _make_body(self, seq: int) -> dict[str, Any]:
        if self.body is not None:
            body = dict(self.body(seq))
            body.setdefault("timeout_ms", self.timeout_ms)
        elif self.inputs_per_call == 1:
            body = {"input": f"{self.prefix} {seq} {uuid.uuid4().hex}", "timeout_ms": self.timeout_ms}
        else:
            body = {"inputs": [f"{self.prefix} {seq}.{k} {uuid.uuid4().hex}" for k in range(self.inputs_per_call)],
                    "timeout_ms": self.timeout_ms}
        if self.tenant is not None:
            body.setdefault("tenant", self.tenant)
        return body

    def _one(self, seq: int) -> Outcome:
        body = self._make_body(seq)
        deadline_s = float(body.get("timeout_ms", self.timeout_ms)) / 1000
        url, sent_at = self.url, time.monotonic()
        try:
            response = requests.post(url, json=body, headers=self.headers,
                                     timeout=(5.0, deadline_s + CLIENT_SLACK_S))
        except Exception as exc:  # no HTTP answer; still an outcome: nothing may go unaccounted for
            elapsed = time.monotonic() - sent_at
            return Outcome(seq, sent_at, 0, elapsed * 1000, elapsed > deadline_s + LATE_SLACK_S,
                           no_answer=no_answer_kind(exc))
        elapsed = time.monotonic() - sent_at
        outcome = Outcome(seq, sent_at, response.status_code, elapsed * 1000, elapsed > deadline_s + LATE_SLACK_S)
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code == 200:
            outcome.wrong_output = not _own_output(body, data)
        else:
            error = data.get("error") if isinstance(data, dict) else None
            if isinstance(error, dict) and isinstance(error.get("type"), str) and error.get("message"):
                outcome.error_type = error["type"]
                outcome.error_message = str(error["message"])[:300]
                outcome.non_json = not response.headers.get("Content-Type", "").startswith("application/json")
            else:
                outcome.non_json = True
        return outcome

    # -- the end -----------------------------------------------------------------------------------------
    def stop(self, drain_s: float = 30) -> LoadReport:
        """Stop sending, wait up to ``drain_s`` (at least every deadline + the client's slack) for every
        outstanding request, and report."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._stopped_at = time.monotonic()
        with self._lock:
            futures = list(self._futures)
        until = time.monotonic() + max(drain_s, self.timeout_ms / 1000 + CLIENT_SLACK_S + 10)
        outcomes = []
        for seq, future in enumerate(futures):
            try:
                outcomes.append(future.result(timeout=max(0.0, until - time.monotonic())))
            except Exception as exc:  # should not happen: _one never raises; count it as no answer
                outcomes.append(Outcome(seq, 0.0, 0, 0.0, True, no_answer=f"unfinished:{type(exc).__name__}"))
        self._pool.shutdown(wait=False, cancel_futures=True)
        return report_of(outcomes, self._stopped_at - self._started_at)

    def __enter__(self) -> SteadyLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if not self._stop.is_set():
            self.stop()


def no_answer_kind(exc: BaseException) -> str:
    """Why no HTTP answer came: 'refused' (never reached a server: nothing was admitted), 'reset' (the
    connection broke after the request was sent), 'timeout' (the client gave up at deadline + 5 s), or the
    exception's class."""
    if isinstance(exc, requests.Timeout):
        return "timeout"
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and len(seen) < 10:
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__ or (cause.args[0] if cause.args and isinstance(
            cause.args[0], BaseException) else None)
    text = " ".join(f"{type(e).__name__} {e}" for e in seen)
    if "ConnectionRefused" in text or "Connection refused" in text:
        return "refused"
    if any(s in text for s in ("ConnectionReset", "Connection reset", "RemoteDisconnected", "Connection aborted",
                               "BrokenPipe", "IncompleteRead", "ChunkedEncodingError")):
        return "reset"
    return type(exc).__name__


def _own_output(body: dict[str, Any], data: object) -> bool:
    if not isinstance(data, dict):
        return False
    if "input" in body:
        return bool(data.get("output") == expected(body["input"]))
    if "inputs" in body:
        return bool(data.get("outputs") == [expected(t) for t in body["inputs"]])
    return True  # a custom body of another shape: the caller checks its own outputs


def report_of(outcomes: list[Outcome], duration_s: float = 0.0) -> LoadReport:
    return LoadReport(
        sent=len(outcomes),
        statuses=collections.Counter(o.status for o in outcomes),
        error_types=collections.Counter(o.error_type for o in outcomes if o.error_type),
        wrong_output=sum(1 for o in outcomes if o.wrong_output),
        late=sum(1 for o in outcomes if o.late),
        latencies_ms=[o.latency_ms for o in outcomes if o.status != 0],
        non_json=sum(1 for o in outcomes if o.non_json),
        no_answer_kinds=collections.Counter(o.no_answer for o in outcomes if o.no_answer),
        duration_s=duration_s,
        error_examples={t: m for o in reversed(outcomes) if (t := o.error_type) and (m := o.error_message)},
        error_messages=collections.Counter(f"{o.error_type}: {o.error_message[:120]}" for o in outcomes
                                           if o.error_type and o.error_message),
        outcomes=outcomes,
    )


def warm(load: SteadyLoad, answered: int = 40, timeout_s: float = 30) -> None:
    """Let the load run until ``answered`` requests came back, so a fault lands on a system in full flow."""
    wait_for(lambda: load.answered() >= answered, timeout_s, f"{answered} answers before the fault")


def carry_on(load: SteadyLoad, seconds: float = 2.0, timeout_s: float = 30) -> None:
    """Keep the load on for ``seconds`` more of arrivals (a count of arrivals, not a sleep)."""
    mark = load.sent + int(seconds * load.rate)
    wait_for(lambda: load.sent >= mark, timeout_s, f"{mark} requests sent")
