"""The multi-host harness: one system (gunicorn, batchers, sim GPU workers) spread over the hosts of a
:class:`~harness.netns.topology.Network`, with RabbitMQ and Redis on its svc host.

Hosts: ``svc`` (:class:`~harness.netns.servicehost.ServiceHost`); ``api`` (``api2``, …): gunicorn bound to its
address (``LLMB_WEB_BIND``); ``batcher1``, ``batcher2``: one ``llmb-batcher`` each; ``gpu1``, ``gpu2``: one sim
``gpu-worker --gpu 0 --host gpuN`` each (queue ``<ns>.gpu.gpuN.0``, worker id ``gpu0@gpuN``); ``client``: where
the load generator and every check of the test run from. Every process is started with ``ip netns exec`` and
reaches RabbitMQ and Redis only over the bridge.

**The test process stays in the root namespace.** Work that must happen on the client host (the load, the
Redis and RabbitMQ checks, HTTP probes) runs on a thread that entered the client namespace
(:class:`~harness.netns.topology.NetnsThread`), so sockets it opens belong to the client host.
:meth:`Hosts.on_client` runs a function there; :meth:`Hosts.load` starts a SteadyLoad there.

**Teardown** (:meth:`Hosts.close`, also run at interpreter exit) kills every process of every namespace of
the harness (``ip netns pids``, so daemons such as epmd go too), deletes the namespaces (and with them the
bridge and veths) and the node's temporary directory.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
import requests
from kombu import Connection

from harness.helpers import decoded, expected, scored
from harness.loadgen import SteadyLoad
from harness.netns.servicehost import ServiceHost, servers_unavailable
from harness.netns.topology import DEFAULT_HOSTS, WEB_PORT, NetnsThread, Network, Proc, netns_unavailable, tail
from harness.stack import ROOT, wait_for

T = TypeVar("T")

BIN = Path(sys.executable).parent


def unavailable() -> str | None:
    """Why this machine cannot run the harness (None: it can): root, ``ip netns``, veth/bridge, the servers."""
    return netns_unavailable() or servers_unavailable()


@dataclass
class Timings:
    network_s: float = 0.0
    rabbitmq_s: float = 0.0
    redis_s: float = 0.0
    processes_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Hosts:
    """Namespaces, bridge, services and processes of one system spread over hosts; see the module docstring.

    ``hosts``: the hosts besides ``svc`` and ``client`` (names from
    :data:`~harness.netns.topology.ADDRESSES`; ``api*``, ``batcher*`` and ``gpu*`` get their process).
    ``env``: LLMB_* settings for every process (``sim_batch_ms=300`` -> ``LLMB_SIM_BATCH_MS=300``). ``logs``:
    where process logs (and the ledger's SQLite file) go; a temporary directory, removed at close, when omitted.
    ``web_workers``: gunicorn processes per API host.
    """

    def __init__(self, hosts: Iterable[str] = DEFAULT_HOSTS, *, logs: Path | None = None, web_workers: int = 1,
                 rabbit_heartbeat_s: int | None = None, **env: object) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.namespace = "h" + self.tag  # LLMB_NAMESPACE: queues and keys of this harness only
        self.net = Network(self.tag, ("svc", "client", *hosts))
        self.hosts = self.net.hosts
        self.switch = self.net.switch
        self.own_logs = logs is None
        self.logs = Path(tempfile.mkdtemp(prefix=f"llmbh-{self.tag}-logs-")) if logs is None else logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.services = ServiceHost(self.net, self.tag, self.logs, rabbit_heartbeat_s, self.on_client)
        self.rabbit_dir, self.node = self.services.rabbit_dir, self.services.node
        self.rabbit_heartbeat_s = rabbit_heartbeat_s  # the node's own heartbeat proposal (None: RabbitMQ's 60 s)
        self.web_workers = web_workers
        self.broker_url, self.redis_url = self.services.broker_url, self.services.redis_url
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("LLMB_")},
                    "LLMB_NAMESPACE": self.namespace, "LLMB_BROKER_URL": self.broker_url,
                    "LLMB_REDIS_URL": self.redis_url, "LLMB_DATABASE_URL": f"sqlite:///{self.logs / 'ledger.db'}",
                    "LLMB_AUTH": "none", "PYTHONUNBUFFERED": "1"}
        self.env.update({f"LLMB_{k.upper()}": str(v) for k, v in env.items()})
        self.procs: dict[str, Proc] = {}
        self.timings = Timings()
        self._client: NetnsThread | None = None
        self._redis: redis.Redis | None = None
        self._closed = False
        atexit.register(self.close)

    # -- names -------------------------------------------------------------------------------------------------
    def addr(self, host: str) -> str:
        return self.hosts[host].addr

    def url(self, host: str = "api") -> str:
        return f"http://{self.addr(host)}:{WEB_PORT}"

    def host_of_addr(self, addr: str) -> str | None:
        return self.net.host_of_addr(addr)

    @property
    def gpu_hosts(self) -> list[str]:
        return [h for h in self.hosts if h.startswith("gpu")]

    @property
    def batcher_hosts(self) -> list[str]:
        return [h for h in self.hosts if h.startswith("batcher")]

    @property
    def api_hosts(self) -> list[str]:
        return [h for h in self.hosts if h.startswith("api")]

    def worker_id(self, host: str) -> str:
        return f"gpu0@{host}"

    def gpu_queue(self, host: str) -> str:
        return f"{self.namespace}.gpu.{host}.0"

    @property
    def request_queue(self) -> str:
        return f"{self.namespace}.requests"

    # -- bring-up ----------------------------------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self, start_processes: bool = True) -> Hosts:
        t0 = time.monotonic()
        self.network()
        self.timings.network_s = time.monotonic() - t0
        self._client = NetnsThread(self.hosts["client"].ns)
        self.start_services()
        self.admin("db", "upgrade")
        if start_processes:
            t0 = time.monotonic()
            for host in self.hosts:
                self.start(host)
            self.wait_serving()
            self.timings.processes_s = time.monotonic() - t0
        return self

    def network(self) -> None:
        self.net.build()

    def start_services(self) -> None:
        self.timings.redis_s, self.timings.rabbitmq_s = self.services.start(self.procs)

    # -- processes ---------------------------------------------------------------------------------------------
    def spawn(self, name: str, host: str, argv: list[str], raw_env: dict[str, str] | None = None,
              settings: Mapping[str, object] | None = None) -> Proc:
        """Start ``argv`` on ``host`` (``ip netns exec``) as ``name``, in a process group of its own; ``settings``:
        LLMB_* settings of this process only, without the prefix."""
        extra = {f"LLMB_{k.upper()}": str(v) for k, v in (settings or {}).items()} | (raw_env or {})
        log_path = self.logs / f"{name}.log"
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *argv], cwd=ROOT,
                                     env={**self.env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.procs[name] = Proc(name, host, popen, log_path)
        return self.procs[name]

    def start(self, host: str, **env: object) -> Proc | None:
        """Start ``host``'s process (the process named after its host); None for svc and client."""
        if host.startswith("gpu"):
            return self.spawn(host, host, [str(BIN / "gpu-worker"), "--gpu", "0", "--host", host, "--backend", "sim"],
                              settings=env)
        if host.startswith("batcher"):
            return self.spawn(host, host, [str(BIN / "llmb-batcher"), "--hostname", f"{host}.{self.namespace}@{host}"],
                              settings=env)
        if host.startswith("api"):
            env = {"web_bind": f"{self.addr(host)}:{WEB_PORT}", "web_workers": self.web_workers, **env}
            return self.spawn(host, host, [str(BIN / "gunicorn"), "-c", "webapp/gunicorn_conf.py",
                                           "webapp:create_app()"],
                              raw_env={"PROMETHEUS_MULTIPROC_DIR": str(self.logs / f"metrics-{host}")}, settings=env)
        return None

    def running(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.popen.poll() is None

    def signal(self, name: str, sig: int = signal.SIGTERM, wait_s: float = 30) -> int | None:
        """Signal ``name``'s process group and wait for it to end (SIGKILL after ``wait_s``); its exit code."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, sig)
        try:
            return proc.popen.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            return proc.popen.wait(timeout=30)

    def children(self, name: str) -> list[int]:
        from harness.stack import children_of
        return children_of(self.procs[name].popen.pid)

    def log(self, name: str) -> str:
        proc = self.procs.get(name)
        path = proc.log if proc is not None else self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def admin(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``llmb-admin`` run on the client host against this system."""
        done = subprocess.run(["ip", "netns", "exec", self.hosts["client"].ns, str(BIN / "llmb-admin"), *args],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"llmb-admin {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout}\n{done.stderr}")
        return done

    # -- links -------------------------------------------------------------------------------------------------
    @property
    def cut_hosts(self) -> set[str]:
        return self.net.cut_hosts

    def cut(self, host: str) -> float:
        """Pull ``host``'s cable (its bridge port down: packets dropped silently both ways); time.monotonic()."""
        return self.net.cut(host)

    def restore(self, host: str) -> float:
        return self.net.restore(host)

    def restore_all(self) -> None:
        self.net.restore_all()

    # -- the client host ---------------------------------------------------------------------------------------
    def on_client(self, fn: Callable[..., T], *args: Any, timeout: float = 120, **kwargs: Any) -> T:
        """Run ``fn`` on a thread of the client host (its sockets are the client's)."""
        if self._client is None:
            raise RuntimeError("the harness is not up")
        return self._client.call(fn, *args, timeout=timeout, **kwargs)

    def redis(self, fn: Callable[[redis.Redis], T]) -> T:
        """``fn(client)`` with a Redis client of the client host, on the client host's thread."""
        def call() -> T:
            if self._redis is None:
                self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=3, socket_connect_timeout=3)
            return fn(self._redis)
        return self.on_client(call)

    def load(self, host: str, rate: float, **kwargs: Any) -> SteadyLoad:
        """A SteadyLoad against ``host``'s API, sent from the client host (started)."""
        load = SteadyLoad(self.url(host), rate, **kwargs)
        self.on_client(load.start)  # its arrival thread, and the threads that thread starts, are the client's
        return load

    def post(self, host: str, body: dict[str, Any], timeout: float = 30) -> requests.Response:
        return self.on_client(lambda: requests.post(self.url(host) + "/v1/infer", json=body, timeout=timeout),
                              timeout=timeout + 10)

    def get(self, host: str, path: str, timeout: float = 5) -> requests.Response:
        return self.on_client(lambda: requests.get(self.url(host) + path, timeout=timeout), timeout=timeout + 10)

    def serves(self, host: str = "api", timeout: float = 15) -> bool:
        """A fresh request through ``host`` answered 200 with its own output."""
        text = f"probe {uuid.uuid4().hex}"
        try:
            r = self.post(host, {"input": text, "timeout_ms": int(timeout * 1000)}, timeout=timeout + 5)
        except requests.RequestException:
            return False
        return r.status_code == 200 and r.json().get("output") == expected(text)

    # -- state, as the client host reads it --------------------------------------------------------------------
    def fleet(self) -> dict[str, dict[str, Any]]:
        """Heartbeats by worker id, as the workers wrote them."""
        raw = self.redis(lambda r: r.hgetall(f"{self.namespace}:fleet"))
        return {decoded(k): json.loads(v) for k, v in raw.items()}

    def fresh(self, host: str, stale_s: float | None = None) -> bool:
        """Whether ``host``'s worker has heartbeated (idle or busy) within the stale time."""
        return self.beat(host, stale_s) is not None

    def beat(self, host: str, stale_s: float | None = None, fleet: Mapping[str, dict[str, Any]] | None = None
             ) -> dict[str, Any] | None:
        """``host``'s worker's heartbeat if it is fresh (idle or busy, within the stale time), else None; read from
        ``fleet`` (one reading of the fleet, to judge several workers by) or from a reading of its own. A worker
        that came back may still be missing from the next reading: a batcher that took it for lost removes its
        entry once it has sent its batches back, and the worker's next beat writes it again."""
        stale = self.heartbeat_stale_s if stale_s is None else stale_s
        beat = (self.fleet() if fleet is None else fleet).get(self.worker_id(host))
        if not beat or beat["state"] not in ("idle", "busy") or time.time() - float(beat["heartbeat_at"]) >= stale:
            return None
        return beat

    @property
    def heartbeat_stale_s(self) -> float:
        return float(self.env.get("LLMB_HEARTBEAT_INTERVAL_S", 1.0)) * float(
            self.env.get("LLMB_HEARTBEAT_STALE_FACTOR", 3.0))

    def inflight(self) -> int:
        """Items admitted and not yet answered, across every API process (the admission set)."""
        return int(self.redis(lambda r: r.zcard(f"{self.namespace}:inflight")))

    def leases(self) -> dict[str, float]:
        """API processes' admission leases: instance -> seconds until expiry (Redis's clock)."""
        def read(r: redis.Redis) -> tuple[list[tuple[str, float]], tuple[int, int]]:
            return scored(r.zrange(f"{self.namespace}:inflight:instances", 0, -1, withscores=True)), r.time()
        members, (sec, usec) = self.redis(read)
        now = sec + usec / 1e6
        return {m: score - now for m, score in members}

    def queue(self, name: str) -> tuple[int, int]:
        """(messages ready, consumers) of a queue, by a passive declare from the client host."""
        def declare() -> tuple[int, int]:
            with Connection(self.broker_url, connect_timeout=3) as conn:
                _, ready, consumers = conn.default_channel.queue_declare(name, passive=True)
                return int(ready), int(consumers)
        try:
            return self.on_client(declare)
        except Exception:  # not declared yet
            return 0, 0

    def rabbitmqctl(self, *args: str, timeout: float = 60) -> str:
        """rabbitmqctl against the private node, run on svc (where its epmd is)."""
        return self.services.rabbitmqctl(*args, timeout=timeout)

    def connections(self) -> list[dict[str, str]]:
        """The node's client connections: host (by peer address), heartbeat timeout (s), client name."""
        return self.services.connections()

    def active_batcher(self) -> str | None:
        """The batcher host RabbitMQ delivers requests to now (single active consumer), or None."""
        return self.services.active_consumer(self.request_queue)

    # -- whole and serving -------------------------------------------------------------------------------------
    def restart_missing(self) -> list[str]:
        started = []
        for host in self.hosts:
            if (host.startswith(("gpu", "batcher", "api"))) and not self.running(host):
                self.procs.pop(host, None)
                self.start(host)
                started.append(host)
        return started

    def wait_serving(self, timeout_s: float = 60) -> None:
        """Every worker heartbeating, every batcher consuming the request queue, every API answering."""
        gpus, batchers, apis = self.gpu_hosts, self.batcher_hosts, self.api_hosts
        for name, proc in self.procs.items():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{tail(proc.log)}")

        def all_fresh() -> bool:
            beats = self.fleet()  # every worker judged by one reading of the fleet
            return all(self.beat(h, fleet=beats) for h in gpus)

        wait_for(all_fresh, timeout_s, f"fresh heartbeats from {gpus}")
        wait_for(lambda: self.queue(self.request_queue)[1] == len(batchers), timeout_s,
                 f"{len(batchers)} batcher(s) consuming {self.request_queue}")
        for host in apis:
            wait_for(lambda h=host: self.get(h, "/readyz").status_code == 200, timeout_s, f"{host} ready")
            wait_for(lambda h=host: self.serves(h), timeout_s, f"{host} serving a request")

    def whole(self, timeout_s: float = 60) -> None:
        """Links restored, missing processes started again, and the system serving."""
        self.restore_all()
        self.restart_missing()
        self.wait_serving(timeout_s)

    # -- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.procs.values():  # a chance to leave cleanly first (SIGTERM), not waited for long
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
        self.net.kill_everything()  # whatever else lives in a namespace of ours (epmd, orphans)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        self.procs.clear()
        if self._client is not None:
            self._client.close()
        self.net.delete()
        self.services.remove()
        if self.own_logs:
            shutil.rmtree(self.logs, ignore_errors=True)
        atexit.unregister(self.close)


@contextlib.contextmanager
def hosts(**kwargs: Any) -> Iterator[Hosts]:
    """``with hosts(...) as h:`` the same as ``with Hosts(...) as h:``."""
    with Hosts(**kwargs) as h:
        yield h
