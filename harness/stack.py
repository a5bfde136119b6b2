"""Start the real system for end-to-end tests: gunicorn, the batcher and sim GPU workers as processes.

Each stack gets its own namespace, so its queues and Redis keys are its own and are removed afterwards.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar, overload

import redis
import requests
from kombu import Connection

from harness.helpers import decoded
from tasks.state.connect import redis_client

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BROKER_URL = os.environ.get("LLMB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("LLMB_REDIS_URL", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    def __init__(self, tmp: Path, **env: object) -> None:
        self.namespace = "t" + uuid.uuid4().hex[:10]
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.database_url = f"sqlite:///{tmp / 'ledger.db'}"
        # each server its own metrics folder (gunicorn_conf.py makes one per namespace and port, and empties it at
        # start): one inherited from this process would be shared, and emptied under a running stack
        inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        self.env = {**inherited, "LLMB_NAMESPACE": self.namespace, "LLMB_BROKER_URL": BROKER_URL,
                    "LLMB_REDIS_URL": REDIS_URL, "LLMB_DATABASE_URL": self.database_url, "PYTHONUNBUFFERED": "1",
                    "LLMB_AUTH": "none"}  # tests of keys ask for LLMB_AUTH=keys
        self.env.update({f"LLMB_{k.upper()}": str(v) for k, v in env.items()})
        self.admin("db", "upgrade")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.groups: set[int] = set()  # every process group spawned, so that close() leaves no orphan behind
        self.redis = redis_client(self.env["LLMB_REDIS_URL"])  # a plain Redis, or the master behind Sentinel
        self.port = 0

    # -- processes -----------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], raw_env: dict[str, str] | None = None,
               settings: Mapping[str, object] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` as ``name``; ``settings``: LLMB_* settings of this process only, without the prefix."""
        extra = {f"LLMB_{k.upper()}": str(v) for k, v in (settings or {}).items()} | (raw_env or {})
        with open(self.tmp / f"{name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **extra}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        self.groups.add(proc.pid)
        return proc

    def admin(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `llmb-admin` against this stack, as an operator would."""
        done = subprocess.run([str(BIN / "llmb-admin"), *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"llmb-admin {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout}\n{done.stderr}")
        return done

    def fleet(self) -> dict[str, dict[str, Any]]:
        """Heartbeats by worker id, as the workers wrote them."""
        return {decoded(k): json.loads(v) for k, v in self.redis.hgetall(f"{self.namespace}:fleet").items()}

    def start_worker(self, device: int, backend: str = "sim", model: str | None = None,
                     **env: object) -> subprocess.Popen[bytes]:
        argv = [str(BIN / "gpu-worker"), "--gpu", str(device), "--host", "test", "--backend", backend]
        return self._spawn(f"gpu{device}", argv + (["--model", model] if model else []), settings=env)

    def start_batcher(self, name: str = "batcher", **env: object) -> subprocess.Popen[bytes]:
        return self._spawn(name, [str(BIN / "llmb-batcher"), "--hostname", f"{name}.{self.namespace}@test"],
                           settings=env)

    def start_jobs(self, name: str = "jobs", **env: object) -> subprocess.Popen[bytes]:
        """An `llmb-jobs` process (the Batch API's job runner)."""
        return self._spawn(name, [str(BIN / "llmb-jobs")], settings=env)

    FLOWER_AUTH = ("ops", "flower-test-secret")

    def start_flower(self) -> str:
        """Flower as the Procfile runs it, with the basic auth the Procfile asks for to open its API."""
        port = free_port()
        self._spawn("flower", [str(BIN / "celery"), "-A", "tasks.broker.celery_app", "flower", "--address=127.0.0.1",
                               f"--port={port}"], raw_env={"FLOWER_BASIC_AUTH": ":".join(self.FLOWER_AUTH)})
        return f"http://127.0.0.1:{port}"

    def start_web(self, name: str = "web", workers: int = 2, port: int | None = None, **env: object) -> str:
        """gunicorn on ``port`` (a free one by default; pass the old one to restart it where callers know it)."""
        port = port or free_port()
        self._spawn(name, [str(BIN / "gunicorn"), "-c", "webapp/gunicorn_conf.py", "webapp:create_app()"],
                    settings={"web_bind": f"127.0.0.1:{port}", "web_workers": workers, **env})
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(url + "/healthz") == 200, 20, f"gunicorn on {url}")
        if name == "web":
            self.port = port
        return url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # it did not stop on its own: nothing may outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    # -- faults: single processes of a running component ---------------------------------------------
    def pid(self, name: str) -> int:
        """The process this stack started as ``name`` (gunicorn's master, a worker's supervisor, the batcher)."""
        return self.procs[name].pid

    def children(self, name: str) -> list[int]:
        """Live child processes of ``name``'s process (gunicorn's workers, a supervisor's worker), oldest first."""
        return children_of(self.pid(name))

    def web_workers(self, name: str = "web") -> list[int]:
        """gunicorn's worker processes."""
        return self.children(name)

    def worker_child(self, device: int) -> int:
        """The worker process that the supervisor of ``gpu<device>`` runs (the one that runs batches)."""
        kids = self.children(f"gpu{device}")
        if not kids:
            raise LookupError(f"gpu{device} has no worker process right now")
        return kids[-1]

    def signal(self, name: str, sig: int, *, group: bool = False) -> None:
        """Send ``sig`` to ``name``'s own process (or its whole process group) and leave it to act on it."""
        pid = self.pid(name)
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)

    def wait_exit(self, name: str, timeout_s: float = 30) -> int:
        """Wait for ``name``'s process to end; returns its exit code and forgets it (its group stays known to
        close(), which ends whatever it left behind)."""
        proc = self.procs[name]
        rc = proc.wait(timeout=timeout_s)
        del self.procs[name]
        return rc

    def wait_batch_start(self, device: int, within_s: float, timeout_s: float = 15,
                         batch_s: float | None = None) -> None:
        """Return just after ``gpu<device>`` starts a batch: the moment to signal a worker early in a batch.

        It waits for the worker's own "started" announcement on the fleet exchange (the batchers' signal, sent
        as the batch starts to run), so it returns within the broker's delivery time of the start, well inside
        ``within_s`` of it, whatever the heartbeats' phase. ``batch_s`` is accepted for older callers and not
        needed: nothing is predicted."""
        from kombu import Queue

        from tasks.broker.queues import fleet_exchange

        worker, started = f"gpu{device}@test", []
        deadline = time.monotonic() + timeout_s
        with Connection(self.broker_url, connect_timeout=5) as conn:
            events = Queue(f"{self.namespace}.fleet.test-{uuid.uuid4().hex}", exchange=fleet_exchange(self.namespace),
                           exclusive=True, auto_delete=True, durable=False)

            def on_event(message: object) -> None:
                event = json.loads(message.body)  # type: ignore[attr-defined]
                if event.get("worker") == worker and event.get("event") == "started":
                    started.append(event.get("batch_id"))

            def a_batch_starts() -> bool:
                # block on the broker (not in wait_for's polling sleep) so the event is taken as it arrives
                while not started and time.monotonic() < deadline:
                    try:
                        conn.drain_events(timeout=max(0.01, deadline - time.monotonic()))
                    except TimeoutError:
                        break
                return bool(started)

            with conn.Consumer(events, on_message=on_event, no_ack=True, accept=["json"]):
                wait_for(a_batch_starts, timeout_s, f"{worker} to start a batch (within {within_s:g} s of it)")

    def wait_idle(self, since: float, workers: int = 2, timeout_s: float = 30) -> None:
        """Wait until every batch dispatched before ``since`` (a ``time.time()``) has run to its end: the queue of
        each of gpu0..gpu<workers-1> has been seen empty and, in a heartbeat taken after that (and after
        ``since``), each reports itself idle with nothing received and unfinished."""
        names = [f"gpu{n}@test" for n in range(workers)]
        emptied: list[float] = []  # when every worker queue was first seen empty (reset when one was not)

        def idle() -> bool:
            beats = self.fleet()
            if any(name not in beats for name in names):
                return False
            if any(self.queue_depth(str(beats[name]["queue"])) for name in names):
                emptied.clear()
                return False
            if not emptied:
                emptied.append(time.time())
                return False
            after = max(since, emptied[0])
            return all(float(beats[name]["heartbeat_at"]) > after and beats[name]["state"] == "idle"
                       and not int(beats[name].get("outstanding") or 0) for name in names)

        wait_for(idle, timeout_s, f"{workers} worker(s) idle, with empty queues, in heartbeats since {since:.3f}")

    def inflight(self) -> int:
        """Items admitted and not yet answered, across every API process (the admission set)."""
        return int(self.redis.zcard(f"{self.namespace}:inflight"))

    def tenant_inflight(self, tenant: str) -> int:
        """Items of ``tenant`` admitted and not yet answered (its admission set): its backlog in the system."""
        return int(self.redis.zcard(f"{self.namespace}:inflight:t:{tenant}"))

    def arrivals(self, model: str) -> int:
        """Items that arrived for ``model`` in the last minute, admitted or not (the admission script's
        per-second counters, which the arrival rate on /metrics is the mean of)."""
        keys = list(self.redis.scan_iter(f"{self.namespace}:inflight:m:{model}:rate:*", count=1000))
        return sum(int(v or 0) for v in self.redis.mget(keys)) if keys else 0

    # -- whole again after a fault ---------------------------------------------------------------------
    @property
    def heartbeat_stale_s(self) -> float:
        return float(self.env.get("LLMB_HEARTBEAT_INTERVAL_S", 1.0)) * float(
            self.env.get("LLMB_HEARTBEAT_STALE_FACTOR", 3.0))

    def restart_missing(self, workers: int = 2, web_workers: int = 2) -> list[str]:
        """Start again whichever of gpu0..gpu<workers-1>, the batcher and gunicorn is not running (as an operator
        or an init system would after a fault); returns their names."""
        started = []
        for name in [*(f"gpu{n}" for n in range(workers)), "batcher", "web"]:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                continue
            self.procs.pop(name, None)
            if name.startswith("gpu"):
                self.start_worker(int(name[3:]))
            elif name == "batcher":
                self.start_batcher()
            else:
                self.start_web(workers=web_workers)
            started.append(name)
        return started

    def wait_serving(self, workers: int = 2, web_workers: int = 2, timeout_s: float = 30) -> None:
        """Wait until the stack is whole and serves: a fresh heartbeat (idle or busy) from every worker, a worker
        process under every supervisor, all of gunicorn's workers, and a request answered 200 with its output."""
        from harness.helpers import expected

        def fresh() -> bool:
            beats, now = self.fleet(), time.time()
            return all(f"gpu{n}@test" in beats and now - float(beats[f"gpu{n}@test"]["heartbeat_at"])
                       < self.heartbeat_stale_s and beats[f"gpu{n}@test"]["state"] in ("idle", "busy")
                       for n in range(workers))

        wait_for(fresh, timeout_s, f"{workers} fresh heartbeats")
        wait_for(lambda: len(self.web_workers()) == web_workers, timeout_s, f"{web_workers} gunicorn workers")
        wait_for(lambda: all(self.children(f"gpu{n}") for n in range(workers)), timeout_s,
                 "a worker process under every supervisor")
        probe = f"probe {uuid.uuid4().hex}"
        r = requests.post(self.url + "/v1/infer", json={"input": probe, "timeout_ms": 10_000}, timeout=30)
        if r.status_code != 200 or r.json().get("output") != expected(probe):
            raise AssertionError(f"the stack does not serve: {r.status_code} {r.text}")

    def live_workers(self) -> int:
        body = requests.get(self.url + "/readyz", timeout=5)
        return int(body.json().get("workers", 0)) if body.status_code == 200 else 0

    def wait_ready(self, workers: int) -> None:
        wait_for(lambda: self.live_workers() >= workers, 30, f"{workers} live worker(s)")

    @property
    def broker_url(self) -> str:
        return self.env["LLMB_BROKER_URL"]

    def request_queue_depth(self) -> int:
        with Connection(self.broker_url) as conn:
            _, count, _ = conn.default_channel.queue_declare(f"{self.namespace}.requests", passive=True)
            return int(count)

    def queue_depth(self, queue: str) -> int:
        """Messages ready (not yet delivered) in a RabbitMQ queue of this stack."""
        with Connection(self.broker_url) as conn:
            _, count, _ = conn.default_channel.queue_declare(queue, passive=True)
            return int(count)

    def request_queue_consumers(self) -> int:
        """Batchers consuming the request queue now (0 if it does not exist yet)."""
        try:
            with Connection(self.broker_url) as conn:
                _, _, consumers = conn.default_channel.queue_declare(f"{self.namespace}.requests", passive=True)
                return int(consumers)
        except Exception:  # not declared yet
            return 0

    def items_done(self) -> int:
        return int(self.redis.get(f"{self.namespace}:stats:items_done") or 0)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    # -- teardown ------------------------------------------------------------------------------------
    def leftovers(self) -> list[int]:
        """Live processes of the groups this stack started that still carry its namespace (never anyone
        else's process, should a group id have been reused)."""
        mark = f"LLMB_NAMESPACE={self.namespace}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) not in self.groups or fields[0] == "Z":
                    continue
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
        return found

    def close(self) -> None:
        for name in list(self.procs):
            try:
                self.kill(name, signal.SIGTERM)
            except ProcessLookupError:
                pass
            except Exception:  # one stubborn process must not leave the others running
                self.procs.pop(name, None)
        for pid in self.leftovers():  # an orphaned worker whose supervisor was killed, say
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        try:
            for key in self.redis.scan_iter(f"{self.namespace}:*", count=1000):
                self.redis.delete(key)
        except redis.RedisError:
            pass  # a test's own Redis may be gone already
        with Connection(self.broker_url, connect_timeout=5) as conn:
            channel = conn.default_channel
            for queue in [f"{self.namespace}.requests", f"{self.namespace}.batcher", f"{self.namespace}.recovery",
                          *(f"{self.namespace}.gpu.test.{n}" for n in range(4))]:
                try:
                    channel.queue_delete(queue)
                except Exception:
                    channel = conn.channel()


S = TypeVar("S", bound=Stack)
V = TypeVar("V")
WorkerSpec = int | tuple[int, Mapping[str, object]]  # a device index, or one with its own settings


@overload
def running_stack(tmp: Path, *, workers: Sequence[WorkerSpec] = ..., batchers: int = ...,
                  web_workers: int | None = ..., jobs: Sequence[str] = ..., ready: bool = ...,
                  settings: Mapping[str, object] | None = ..., factory: Callable[..., S],
                  **env: object) -> AbstractContextManager[S]: ...


@overload
def running_stack(tmp: Path, *, workers: Sequence[WorkerSpec] = ..., batchers: int = ...,
                  web_workers: int | None = ..., jobs: Sequence[str] = ..., ready: bool = ...,
                  settings: Mapping[str, object] | None = ..., **env: object) -> AbstractContextManager[Stack]: ...


@contextmanager  # type: ignore[misc]
def running_stack(tmp: Path, *, workers: Sequence[WorkerSpec] = (0,), batchers: int = 1,
                  web_workers: int | None = 2, jobs: Sequence[str] = (), ready: bool = True,
                  settings: Mapping[str, object] | None = None, factory: Callable[..., Stack] = Stack,
                  **env: object) -> Iterator[Stack]:
    """The one way an end-to-end test starts the system: ``workers`` (``1`` or ``(1, {"model": "slow"})``),
    ``batchers`` batchers, gunicorn with ``web_workers`` processes (None: no web API), an `llmb-jobs` per name in
    ``jobs``; ``env`` are settings without their ``LLMB_`` prefix (``settings``: more of them as a mapping, for a
    caller that passes its own on; one given both ways is an error, as a repeated keyword is). It waits until every
    worker is ready, and stops everything (and removes the stack's queues and keys) however the test ends."""
    twice = sorted((settings or {}).keys() & env.keys())
    if twice:
        raise TypeError(f"running_stack() got settings given twice: {', '.join(twice)}")
    stack = factory(tmp, **{**(settings or {}), **env})
    try:
        for spec in workers:
            device, options = (spec, {}) if isinstance(spec, int) else spec
            stack.start_worker(device, **options)  # type: ignore[arg-type]
        for i in range(batchers):
            stack.start_batcher(f"batcher{i}" if i else "batcher")
        if web_workers is not None:
            stack.start_web(workers=web_workers)
        for name in jobs:
            stack.start_jobs(name)
        if ready and workers:
            stack.wait_ready(workers=len(workers))
        yield stack
    finally:
        stack.close()


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid``, oldest first (from /proc, no extra dependency)."""
    found: list[tuple[int, int]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append((int(fields[19]), int(entry.name)))  # start time, pid
    return [p for _, p in sorted(found)]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _get(url: str) -> int:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return 0


def wait_for(predicate: Callable[..., V | None], timeout_s: float, what: str) -> V:
    """Poll ``predicate`` until it is true, and return what it returned then (a reading taken once, e.g. a
    worker's heartbeat, to use on without reading again); TimeoutError naming ``what`` once ``timeout_s`` has
    passed. The one way tests wait for the system: on the condition itself, never for a fixed time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if value := predicate():
                return value
        except requests.RequestException:
            pass
        time.sleep(0.1)  # the polling interval
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
