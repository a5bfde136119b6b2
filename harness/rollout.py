"""A rolling upgrade under load: every process of the system replaced one at a time, as a rollout does.

    PYTHONPATH=$PWD python -m harness.rollout              # the table of one rollout (about 2 minutes)
    PYTHONPATH=$PWD python -m harness.rollout --rate 30 --aio-rate 0 --no-embed --json /tmp/rollout.json

The stack is the Procfile's (gunicorn, the batcher, gpu0 sim, an hf-embed worker, a sim-lm worker, ``llmb-jobs``)
plus a second sim worker and a standby batcher (as the Kubernetes manifests run it). Under steady load from pooled
clients (interactive /v1/infer calls on one ``requests.Session`` with retries off, completions through the
``openai`` client on the one sim-lm worker, one streamed chat call at a time, and Batch API jobs through
/v1/batches) each process is replaced in turn:

* gunicorn, in place: SIGHUP (gunicorn starts new workers, then stops the old ones gracefully);
* gunicorn, as a Kubernetes rollout replaces its pod: a new server is started on its own address and, once it
  answers /readyz, the clients' "Service" sends new calls to it; the old one is sent SIGTERM a preStop wait
  later (:data:`PRE_STOP_S`: the endpoints controller's delay in taking the old pod out of the Service). Kept-alive
  connections to the old server stay with it, as they do through kube-proxy;
* the active batcher, then the standby; each gpu-worker supervisor; the jobs runner: SIGTERM, wait for the exit
  (its drain time), start the new one and wait until it serves before the next step.

Per call it records the status, connection errors, the lateness past the call's deadline, a stream cut without a
resume (the client resumes a cut stream with Last-Event-ID, as :mod:`webapp.requests_api` offers) and a batch line
run twice (the ledger's submissions per line); and the drain time of each process type.
"""
from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from harness.helpers import decoded, expected
from harness.stack import Stack, running_stack, wait_for

PRE_STOP_S = 1.0  # the old API server keeps serving this long after the Service stopped sending it new calls
LATE_S = 1.0  # an answer later than deadline + this is late
INFER_TIMEOUT_MS = 10_000
LM_TIMEOUT_MS = 15_000
EMBED_TIMEOUT_MS = 60_000  # the hf-embed worker loads its model again after a restart (11-26 s on 2 busy cores)
CLIENT_SLACK_S = 10.0  # the client gives up this long after a call's deadline (counted as a connection error)
SIM, LM, EMBED = "sim", "sim-lm", "all-MiniLM-L6-v2"


@dataclass
class Call:
    kind: str  # "infer", "completion", "embedding", "stream"
    sent_at: float  # monotonic
    timeout_s: float
    status: int = 0  # 0: no HTTP answer (error says why)
    latency_s: float = 0.0
    error: str = ""
    detail: str = ""  # an error answer's type/message
    wrong_output: bool = False
    cut: bool = False  # a stream whose connection ended before [DONE]
    resumed: bool = False  # ... and that was resumed to its [DONE]

    @property
    def late_s(self) -> float:
        return self.latency_s - self.timeout_s

    @property
    def failed(self) -> bool:
        return self.status != 200 or self.wrong_output or (self.cut and not self.resumed)


@dataclass
class Step:
    name: str
    started: float  # monotonic
    drain_s: float | None = None  # SIGTERM (or SIGHUP) to the old process's exit
    ready_s: float = 0.0  # start of the new one to it serving
    ended: float = 0.0


@dataclass
class JobRun:
    batch_id: str
    lines: int
    status: str = ""
    completed: int = 0
    failed: int = 0
    twice: int = 0  # lines the ledger holds more than one submission of


@dataclass
class Report:
    calls: list[Call] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    jobs: list[JobRun] = field(default_factory=list)
    fleet: list[tuple[float, dict[str, tuple[str, float]], list[str]]] = field(default_factory=list)  # FleetTrace

    def summary(self) -> dict[str, Any]:
        calls, streams = self.calls, [c for c in self.calls if c.kind == "stream"]
        late = [c for c in calls if c.status != 0 and c.late_s > LATE_S]
        drains: dict[str, list[float]] = collections.defaultdict(list)
        for s in self.steps:
            if s.drain_s is not None:
                drains[s.name.split(":")[0]].append(round(s.drain_s, 2))
        return {
            "calls": len(calls),
            "by_kind": dict(collections.Counter(c.kind for c in calls)),
            "statuses": dict(sorted(collections.Counter(c.status for c in calls).items())),
            "failed": sum(c.failed for c in calls),
            "http_errors": sum(1 for c in calls if c.status not in (0, 200)),
            "errors_5xx": sum(1 for c in calls if c.status >= 500),
            "connection_errors": sum(1 for c in calls if c.status == 0),
            "connection_error_kinds": dict(collections.Counter(c.error.split(":")[0] for c in calls if c.status == 0)),
            "error_details": dict(collections.Counter(f"{c.kind} {c.status} {c.detail}"[:120] for c in calls
                                                      if c.status not in (0, 200)).most_common(8)),
            "wrong_output": sum(c.wrong_output for c in calls),
            "late": len(late),
            "longest_late_s": round(max((c.late_s for c in late), default=0.0), 2),
            "streams": len(streams),
            "streams_beginning_5xx": sum(1 for c in streams if c.status >= 500),
            "streams_cut": sum(c.cut for c in streams),
            "streams_cut_not_resumed": sum(c.cut and not c.resumed for c in streams),
            "jobs": len(self.jobs),
            "job_lines": sum(j.lines for j in self.jobs),
            "job_lines_failed": sum(j.failed + (j.lines - j.completed - j.failed) for j in self.jobs),
            "job_lines_run_twice": sum(j.twice for j in self.jobs),
            "drain_s": dict(drains),
        }

    def step_of(self, call: Call) -> str:
        """The step a call was sent during (from a second before it began), or "steady" between steps."""
        return next((s.name for s in self.steps if s.started - 1 <= call.sent_at <= (s.ended or 1e18)), "steady")

    def failures_by_step(self) -> dict[str, int]:
        """Failed or late calls by the step they were sent during."""
        return dict(collections.Counter(self.step_of(c) for c in self.calls
                                        if c.failed or (c.status and c.late_s > LATE_S)))

    def failed_calls(self) -> list[dict[str, Any]]:
        """Every failed or late call, with its step and when it was sent after the step began."""
        begun = {s.name: s.started for s in self.steps}
        return [asdict(c) | {"step": (step := self.step_of(c)), "after_s": round(c.sent_at - begun.get(step, 0.0), 3)}
                for c in self.calls if c.failed or (c.status and c.late_s > LATE_S)]

    def explain(self, logs: Path | None = None, limit: int = 6) -> str:
        """What a failing run's reader needs first: the first failed calls (step, seconds into it, answer), the
        fleet view as Redis held it from 3 s before the first to 1 s after the last, and the processes' log lines
        that speak of lost workers or heartbeats (``logs``: the stack's folder)."""
        failed = [c for c in self.calls if c.failed or (c.status and c.late_s > LATE_S)]
        if not failed:
            return ""
        first, last = min(c.sent_at for c in failed), max(c.sent_at + c.latency_s for c in failed)
        out = [f"{len(failed)} failed or late calls; the first {limit}:"]
        out += [f"  t={c.sent_at - first:+.2f}s {c.kind} {c.status} after {c.latency_s:.2f}s: {c.detail[:100]}"
                for c in sorted(failed, key=lambda c: c.sent_at)[:limit]]
        out += [f"  step {s.name}: {s.started - first:+.2f}s to {s.ended - first:+.2f}s" for s in self.steps
                if s.started - 5 <= last and s.ended + 5 >= first]
        out.append("fleet view (worker: state, heartbeat age; awaited back):")
        out += [f"  t={t - first:+.2f}s {view} back={back}" for t, view, back in self.fleet
                if first - 3 <= t <= last + 1]
        if logs is not None:
            for path in sorted(logs.glob("*.log")):
                lines = [ln for ln in path.read_text(errors="replace").splitlines()
                         if "lost" in ln or "heartbeat" in ln or "clock" in ln]
                out += [f"  {path.name}: {ln[:200]}" for ln in lines[-limit:]]
        return "\n".join(out)


class Service:
    """The address clients call, as a Kubernetes Service is: moved to a new server once it is ready."""

    def __init__(self, url: str) -> None:
        self.url = url


def session() -> requests.Session:
    """A pooled client as a web backend keeps one, retries off (every error counts)."""
    s = requests.Session()
    s.mount("http://", HTTPAdapter(pool_connections=4, pool_maxsize=64, max_retries=0))
    return s


def _detail(r: requests.Response) -> str:
    try:
        e = r.json().get("error") or {}
        return f"{e.get('type') or e.get('code')}: {str(e.get('message'))[:80]}"
    except ValueError:
        return r.text[:80]


class Load:
    """Steady open-loop load on a :class:`Service` from pooled clients, in threads, until :meth:`stop`."""

    def __init__(self, service: Service, rate: float, *, embed: bool, streams: bool = True,
                 aio_rate: float = 0.0) -> None:
        self.service = service
        self.rate = rate
        self.aio_rate = aio_rate  # /v1/infer calls a second more, on one aiohttp session (harness/pooled.py)
        self.embed = embed
        self.streams = streams
        self.http = session()
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sem = threading.BoundedSemaphore(256)
        self._openai_clients: dict[str, Any] = {}

    # -- one call each ------------------------------------------------------------------------------
    def _post(self, call: Call, path: str, body: dict[str, Any]) -> requests.Response | None:
        try:
            r = self.http.post(self.service.url + path, json=body, timeout=call.timeout_s + CLIENT_SLACK_S)
        except requests.RequestException as exc:
            call.error = f"{type(exc).__name__}: {exc}"[:200]
            return None
        finally:
            call.latency_s = time.monotonic() - call.sent_at
        call.status = r.status_code
        if r.status_code != 200:
            call.detail = _detail(r)
        return r

    def _infer(self, n: int) -> None:
        text = f"roll-{n}-{uuid.uuid4().hex[:8]}"
        call = Call("infer", time.monotonic(), INFER_TIMEOUT_MS / 1000)
        r = self._post(call, "/v1/infer", {"input": text, "model": SIM, "timeout_ms": INFER_TIMEOUT_MS})
        if r is not None and r.status_code == 200:
            call.wrong_output = r.json().get("output") != expected(text)
        self._record(call)

    def _openai(self) -> Any:
        """The official client on the Service's address now (one pool per address, retries off)."""
        import openai

        url = self.service.url
        with self._lock:
            if url not in self._openai_clients:
                self._openai_clients[url] = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                          timeout=LM_TIMEOUT_MS / 1000 + CLIENT_SLACK_S)
            return self._openai_clients[url]

    def _completion(self, n: int) -> None:
        import openai

        call = Call("completion", time.monotonic(), LM_TIMEOUT_MS / 1000)
        try:
            got = self._openai().completions.create(model=LM, prompt=f"count to {n}", max_tokens=16,
                                                    extra_body={"timeout_ms": LM_TIMEOUT_MS})
            call.status = 200
            call.wrong_output = not got.choices
        except openai.APIStatusError as exc:
            call.status = exc.status_code
            call.detail = str(exc.message)[:100]
        except openai.APIError as exc:  # no HTTP answer (connection error, time-out): httpx's error is its cause
            cause = exc.__cause__
            call.error = f"{type(exc).__name__}: {exc} ({type(cause).__name__}: {cause})"[:200]
        call.latency_s = time.monotonic() - call.sent_at
        self._record(call)

    def _embedding(self, n: int) -> None:
        call = Call("embedding", time.monotonic(), EMBED_TIMEOUT_MS / 1000)
        r = self._post(call, "/v1/embeddings", {"model": EMBED, "input": f"sentence {n}",
                                                "timeout_ms": EMBED_TIMEOUT_MS})
        if r is not None and r.status_code == 200:
            call.wrong_output = len(r.json()["data"][0]["embedding"]) != 384
        self._record(call)

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)
        self._sem.release()

    # -- streams: one at a time, resumed when cut ----------------------------------------------------
    def _stream_once(self, http: requests.Session) -> None:
        prompt = f"a story {uuid.uuid4().hex[:6]}"
        body: dict[str, Any] = {"model": LM, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 64, "stream": True, "timeout_ms": LM_TIMEOUT_MS}
        call = Call("stream", time.monotonic(), LM_TIMEOUT_MS / 1000)
        last: str | None = None
        request_id = ""
        try:
            with http.post(self.service.url + "/v1/chat/completions", json=body, stream=True,
                           timeout=call.timeout_s + CLIENT_SLACK_S) as r:
                call.status = r.status_code
                request_id = r.headers.get("X-Request-Id", "")
                if r.status_code != 200:
                    call.detail = _detail(r)
                else:
                    done, last = _read_events(r, last)
                    if not done:
                        call.cut = True
        except requests.RequestException as exc:
            if call.status == 0:
                call.error = f"{type(exc).__name__}: {exc}"[:200]
            else:
                call.cut = True
        if call.cut and request_id:
            call.resumed = self._resume(http, request_id, last, call)
        call.latency_s = time.monotonic() - call.sent_at
        with self._lock:
            self.calls.append(call)

    def _resume(self, http: requests.Session, request_id: str, last: str | None, call: Call) -> bool:
        """Resume a cut stream from its last event, on whichever server the Service sends to now."""
        for _ in range(3):
            try:
                with http.get(f"{self.service.url}/v1/requests/{request_id}/stream",
                              headers={"Last-Event-ID": last} if last else {}, stream=True,
                              timeout=call.timeout_s + CLIENT_SLACK_S) as r:
                    if r.status_code != 200:
                        call.detail = f"resume {r.status_code} {_detail(r)}"
                        return False
                    done, last = _read_events(r, last)
                    if done:
                        return True
            except requests.RequestException as exc:
                call.detail = f"resume {type(exc).__name__}"
        return False

    def _streams(self) -> None:
        http = session()
        while not self._stop.is_set():
            self._stream_once(http)

    # -- the open loop ------------------------------------------------------------------------------
    def _arrivals(self) -> None:
        """Calls evenly spaced at ``rate``: of every 10, 7 /v1/infer (the two sim workers), 2 completions (the
        one sim-lm worker) and, with ``embed``, 1 embedding (the one hf-embed worker)."""
        start, n = time.monotonic(), 0
        kinds: list[Callable[[int], None]] = [*[self._infer] * 7, *[self._completion] * 2]
        kinds.append(self._embedding if self.embed else self._infer)
        while not self._stop.is_set():
            delay = start + n / self.rate - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
                continue
            if not self._sem.acquire(timeout=1):
                continue  # the client's own cap: 256 calls outstanding
            threading.Thread(target=kinds[n % len(kinds)], args=(n,), daemon=True).start()
            n += 1

    def _aiohttp(self) -> None:
        """/v1/infer calls at ``aio_rate`` on one aiohttp session: a client that does not look for a closed
        connection before reusing one ("server disconnected" where the server closes it as a call is sent)."""
        import asyncio

        from harness import pooled

        async def run() -> None:
            http = pooled.session()
            tasks: list[asyncio.Task[pooled.Call]] = []
            start, n = time.monotonic(), 0
            try:
                while not self._stop.is_set():
                    delay = start + n / self.aio_rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.ensure_future(pooled.call(http, self.service.url, "aio",
                                                                   timeout_ms=INFER_TIMEOUT_MS)))
                    n += 1
                for done in await asyncio.gather(*tasks):
                    call = Call("infer-aiohttp", done.sent_at, INFER_TIMEOUT_MS / 1000, done.status, done.latency_s,
                                done.error, f"{done.error_type}: {done.message}" if done.error_type else "",
                                wrong_output=done.status == 200 and not done.own_output)
                    with self._lock:
                        self.calls.append(call)
            finally:
                await http.close()

        asyncio.run(run())

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._arrivals, daemon=True)]
        if self.streams:
            self._threads.append(threading.Thread(target=self._streams, daemon=True))
        if self.aio_rate > 0:
            self._threads.append(threading.Thread(target=self._aiohttp, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Call]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        deadline = time.monotonic() + 60  # the calls still out end by their deadline + slack
        while time.monotonic() < deadline and self._sem._value < 256:
            time.sleep(0.1)
        with self._lock:
            return list(self.calls)


def _read_events(r: requests.Response, last: str | None) -> tuple[bool, str | None]:
    """Read SSE events to [DONE] (True) or to the connection's end (False); the last event id seen."""
    for raw in r.iter_lines():
        line = raw.decode()
        if line.startswith("id: "):
            last = line[4:]
        elif line == "data: [DONE]":
            return True, last
    return False, last


class Jobs:
    """Batch API jobs one after the other through /v1/batches (the ``openai`` client), each checked when done."""

    def __init__(self, stack: Stack, service: Service, lines: int = 200) -> None:
        self.stack = stack
        self.service = service
        self.lines = lines
        self.runs: list[JobRun] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.errors: list[str] = []
        self._pooled: tuple[str, Any] | None = None  # (the API's URL, a client on it)

    def _client(self) -> Any:
        """One pooled client per API server: a new one only once the rollout has moved the load to a new server."""
        import openai

        if self._pooled is None or self._pooled[0] != self.service.url:
            self._pooled = (self.service.url, openai.OpenAI(base_url=self.service.url + "/v1", api_key="none",
                                                            max_retries=0, timeout=30))
        return self._pooled[1]

    def _one(self) -> None:
        tag = uuid.uuid4().hex[:6]
        body = "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/infer",
                                     "body": {"input": f"job-{tag}-{i}", "model": SIM}})
                         for i in range(self.lines)).encode() + b"\n"
        c = self._client()
        f = c.files.create(file=("input.jsonl", body), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/infer", completion_window="24h")
        run = JobRun(b.id, self.lines)
        self.runs.append(run)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                got = self._client().batches.retrieve(b.id)
            except Exception as exc:  # the API being replaced: asked again
                self.errors.append(f"retrieve: {type(exc).__name__}")
                time.sleep(0.5)
                continue
            if got.status in ("completed", "failed", "cancelled", "expired"):
                run.status = got.status
                counts = got.request_counts
                run.completed, run.failed = (counts.completed, counts.failed) if counts else (0, 0)
                return
            time.sleep(0.5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._one()
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                time.sleep(1)

    def start(self) -> Jobs:
        self._thread.start()
        return self

    def stop(self) -> list[JobRun]:
        self._stop.set()
        self._thread.join(timeout=320)
        for run in self.runs:
            run.twice = runs_twice(self.stack, run.batch_id)
        return self.runs


def runs_twice(stack: Stack, batch_id: str) -> int:
    """Lines of a job that the ledger holds more than one submission of (one ledger request per submission)."""
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from tasks.store.models import RequestRecord, make_engine

    with Session(make_engine(stack.database_url)) as s:
        rows = s.execute(select(RequestRecord.correlation_id, func.count()).where(
            RequestRecord.correlation_id.like(f"{batch_id}-%")).group_by(RequestRecord.correlation_id))
        return sum(1 for _, n in rows if int(n) > 1)


# -- the stack and its rollout ------------------------------------------------------------------------
SETTINGS: dict[str, object] = {"jobs_poll_s": 0.5, "log_level": "INFO"}


def worker_specs(embed: bool) -> list[tuple[int, dict[str, object]]]:
    """gpu0 sim, gpu1 hf-embed (the Procfile's ``embed``; a second sim worker in its place without ``embed``),
    gpu2 sim-lm, gpu3 a second sim worker."""
    return [(0, {}), (1, {"backend": "hf-embed"} if embed else {}), (2, {"backend": "sim-lm"}), (3, {})]


@contextmanager
def rollout_stack(tmp: Path, *, embed: bool = True, **env: object) -> Iterator[Stack]:
    with running_stack(tmp, workers=worker_specs(embed), batchers=1, web_workers=2, jobs=("jobs",),
                       ready=False, settings={**SETTINGS, **env}) as s:
        s.start_batcher("standby")
        wait_for(lambda: s.live_workers() >= 4, 240, "4 live workers")
        wait_for(lambda: s.request_queue_consumers() == 2, 60, "two batchers consuming")
        yield s


def worker_serving(s: Stack, device: int) -> bool:
    beat = s.fleet().get(f"gpu{device}@test")
    return beat is not None and beat["state"] in ("idle", "busy") and time.time() - float(beat["heartbeat_at"]) < 2


class Rollout:
    """Replaces every process of a :func:`rollout_stack` one at a time, timing each drain."""

    def __init__(self, stack: Stack, service: Service, *, embed: bool, workers: int = 4, web_workers: int = 2) -> None:
        self.stack = stack
        self.embed = embed
        self.service = service
        self.workers = workers
        self.web_workers = web_workers
        self.steps: list[Step] = []
        self.web_name = "web"
        self._generation = 0

    @contextmanager
    def step(self, name: str) -> Iterator[Step]:
        s = Step(name, time.monotonic())
        self.steps.append(s)
        yield s
        s.ended = time.monotonic()
        print(f"  {name}: drain {s.drain_s if s.drain_s is None else round(s.drain_s, 2)} s, "
              f"new one serving in {s.ready_s:.2f} s", file=sys.stderr, flush=True)

    def _stop(self, name: str, step: Step, sig: int = signal.SIGTERM, timeout_s: float = 120) -> None:
        self.stack.signal(name, sig)
        t0 = time.monotonic()
        self.stack.wait_exit(name, timeout_s=timeout_s)
        step.drain_s = time.monotonic() - t0

    def web_reload(self) -> None:
        """SIGHUP: gunicorn starts new workers, then stops the old ones gracefully."""
        with self.step("web-sighup") as st:
            old = set(self.stack.web_workers(self.web_name))
            t0 = time.monotonic()
            self.stack.signal(self.web_name, signal.SIGHUP)
            def replaced() -> bool:
                now = set(self.stack.web_workers(self.web_name))
                return not old & now and len(now) == self.web_workers

            wait_for(replaced, 60, "old gunicorn workers gone")
            st.drain_s = time.monotonic() - t0

    def web_replace(self) -> None:
        """A new server (a new pod), then the old one out of the Service, a preStop wait, and its SIGTERM."""
        with self.step("web") as st:
            self._generation += 1
            new = f"web{self._generation}"
            t0 = time.monotonic()
            url = self.stack.start_web(new, workers=self.web_workers)
            wait_for(lambda: requests.get(url + "/readyz", timeout=2).status_code == 200, 60, "the new API ready")
            st.ready_s = time.monotonic() - t0
            self.service.url = url
            time.sleep(PRE_STOP_S)  # preStop: the old pod is out of the endpoints before its SIGTERM
            self._stop(self.web_name, st)
            self.web_name = new

    def batchers(self) -> None:
        """The active batcher, then the standby (the new active one by then)."""
        for name in ("batcher", "standby"):
            with self.step(f"batcher:{name}") as st:
                self._stop(name, st)
                t0 = time.monotonic()
                self.stack.start_batcher(name)
                wait_for(lambda: self.stack.request_queue_consumers() == 2, 60, "two batchers consuming")
                st.ready_s = time.monotonic() - t0

    def gpu_workers(self) -> None:
        for device in range(self.workers):
            name = f"gpu{device}"
            with self.step(f"gpu-worker:{name}") as st:
                options = dict(worker_specs(self.embed)[device][1])
                self._stop(name, st)
                t0 = time.monotonic()
                self.stack.start_worker(device, **options)  # type: ignore[arg-type]
                wait_for(lambda d=device: worker_serving(self.stack, d), 240, f"{name} serving")
                st.ready_s = time.monotonic() - t0

    def jobs(self) -> None:
        with self.step("jobs") as st:
            self._stop("jobs", st)
            t0 = time.monotonic()
            self.stack.start_jobs("jobs")
            st.ready_s = time.monotonic() - t0

    def run(self, settle_s: float = 2.0) -> None:
        """The whole rollout, with ``settle_s`` of steady load between steps (the rollout's own pace)."""
        for phase in (self.web_reload, self.web_replace, self.batchers, self.gpu_workers, self.jobs):
            phase()
            time.sleep(settle_s)


class FleetTrace:
    """The fleet view as Redis holds it, every 100 ms: (time, {worker: (state, heartbeat age)}, workers awaited
    back) at each change, to place a refusal against what the API processes could see."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.changes: list[tuple[float, dict[str, tuple[str, float]], list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        ns, r = self.stack.namespace, self.stack.redis
        last: tuple[dict[str, str], list[str]] | None = None
        while not self._stop.wait(0.1):
            try:
                seconds, micros = r.time()
                now = seconds + micros / 1e6
                beats = {decoded(k): json.loads(v) for k, v in r.hgetall(f"{ns}:fleet").items()}
                back = sorted(decoded(k) for k in r.hkeys(f"{ns}:fleet:returning"))
            except Exception:
                continue
            view = {k: (str(b["state"]), round(now - float(b["heartbeat_at"]), 1)) for k, b in beats.items()}
            key = ({k: v[0] + ("/stale" if v[1] > self.stack.heartbeat_stale_s else "") for k, v in view.items()}, back)
            if key != last:
                self.changes.append((time.monotonic(), view, back))
                last = key

    def start(self) -> FleetTrace:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, dict[str, tuple[str, float]], list[str]]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.changes


def run_rollout(tmp: Path, *, rate: float = 40.0, aio_rate: float = 0.0, embed: bool = True, jobs: bool = True,
                warm_s: float = 3.0, **env: object) -> Report:
    """One rolling upgrade of the whole stack under load; the report of every call, step and job."""
    with rollout_stack(tmp, embed=embed, **env) as s:
        service = Service(s.url)
        trace = FleetTrace(s).start()
        load = Load(service, rate, embed=embed, aio_rate=aio_rate).start()
        runner = Jobs(s, service).start() if jobs else None
        time.sleep(warm_s)
        rollout = Rollout(s, service, embed=embed)
        try:
            rollout.run()
            time.sleep(warm_s)
        finally:
            calls = load.stop()
            runs = runner.stop() if runner else []
        report = Report(calls, rollout.steps, runs, trace.stop())
        if runner and runner.errors:
            print(f"  job client errors: {collections.Counter(runner.errors).most_common(4)}", file=sys.stderr)
        return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=40.0, help="calls per second (default 40)")
    p.add_argument("--aio-rate", type=float, default=10.0,
                   help="/v1/infer calls per second more, on one aiohttp session (default 10; 0: none)")
    p.add_argument("--no-embed", action="store_true", help="a second sim worker in place of hf-embed")
    p.add_argument("--no-jobs", action="store_true", help="no Batch API jobs")
    p.add_argument("--json", type=Path, help="write the summary and steps here")
    p.add_argument("--tmp", type=Path, default=Path("/tmp") / f"rollout-{uuid.uuid4().hex[:6]}")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops the stack it started
    report = run_rollout(a.tmp, rate=a.rate, aio_rate=a.aio_rate, embed=not a.no_embed, jobs=not a.no_jobs)
    summary = report.summary()
    for k, v in summary.items():
        print(f"{k:28} {v}")
    print(f"{'failed or late by step':28} {report.failures_by_step()}")
    print(f"{'steps':28} {[(s.name, s.drain_s and round(s.drain_s, 2), round(s.ready_s, 2)) for s in report.steps]}")
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "by_step": report.failures_by_step(),
                                      "steps": [asdict(s) for s in report.steps],
                                      "failed": report.failed_calls(), "fleet": report.fleet}, indent=1))
    print(f"logs: {a.tmp}")


if __name__ == "__main__":
    main()
