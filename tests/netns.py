"""The system as separate hosts: one Linux network namespace per host, joined by a bridge, cables to pull.

    with Hosts(logs=Path("/tmp/run")) as h:     # namespaces, bridge, RabbitMQ + Redis, every process; serving
        load = h.load("api", 40)               # a SteadyLoad (tests/loadgen.py) sent from the client host
        h.cut("gpu1")                           # pull gpu1's cable: its packets are dropped silently, no RST
        h.restore("gpu1")
        report = load.stop()                    # leaving the block tears everything down, even on an error

Topology (10.213.0.0/24 unless :data:`SUBNET` is changed; every namespace is this harness's own, named
``llmbh-<tag>-<host>``):

- ``sw``: the switch, a namespace holding only the bridge ``br0`` and one veth end per host (``to-<host>``);
  nothing touches the root namespace's interfaces or routes;
- ``svc``: a private RabbitMQ node (own node name, epmd, data and logs; AMQP on ``<svc>:5672``) and a private
  Redis (``<svc>:6379``), each bound to svc's bridge address;
- ``api`` (``api2``, …): gunicorn bound to its address (``LLMB_WEB_BIND``);
- ``batcher1``, ``batcher2``: one ``llmb-batcher`` each; ``gpu1``, ``gpu2``: one sim ``gpu-worker --gpu 0
  --host gpuN`` each (queue ``<ns>.gpu.gpuN.0``, worker id ``gpu0@gpuN``);
- ``client``: where the load generator and every check of the test run from.

Every process is started with ``ip netns exec`` and reaches RabbitMQ and Redis only over the bridge.

**Cutting a host** is ``ip link set to-<host> down`` on the bridge side: the host's end loses its carrier and
every packet it sends, or that is sent to it, is dropped without a word (no RST, no FIN): a pulled cable.
Connections stay open on both sides until a timeout (TCP retransmissions, AMQP heartbeats) gives up; once
ARP gives up, new connects to or from the host fail with "no route to host", as on a real LAN.

**The test process stays in the root namespace.** Work that must happen on the client host (the load, the
Redis and RabbitMQ checks, HTTP probes) runs on threads that entered the client namespace with ``setns``
(a network namespace is per thread on Linux, and threads a thread starts inherit it), so sockets they open
belong to the client host. :meth:`Hosts.on_client` runs a function there; :meth:`Hosts.load` starts a
SteadyLoad there.

**Teardown** (:meth:`Hosts.close`, also run at interpreter exit) kills every process of every namespace of
the harness (``ip netns pids``, so daemons such as epmd go too), deletes the namespaces (and with them the
bridge and veths) and the node's temporary directory.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
import requests
from kombu import Connection

from tests.helpers import expected
from tests.loadgen import LoadReport, SteadyLoad, carry_on, warm
from tests.stack import ROOT, wait_for

T = TypeVar("T")

BIN = Path(sys.executable).parent
SUBNET = "10.213.0"  # /24, private to the harness's namespaces (checked against the root namespace's routes)
RABBIT_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # the real script; /usr/sbin's wrapper su's and logs away
RABBITMQCTL = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
AMQP_PORT, REDIS_PORT, WEB_PORT = 5672, 6379, 8000
CLONE_NEWNET = 0x40000000

# host -> last octet of its address
ADDRESSES = {"svc": 2, "api": 3, "api2": 4, "batcher1": 5, "batcher2": 6, "gpu1": 7, "gpu2": 8, "gpu3": 9,
             "client": 20}
DEFAULT_HOSTS = ("api", "batcher1", "batcher2", "gpu1", "gpu2")

_libc = ctypes.CDLL(None, use_errno=True)


# -- availability ----------------------------------------------------------------------------------------------
def unavailable() -> str | None:
    """Why this machine cannot run the harness (None: it can): root, ``ip netns``, veth/bridge, the servers."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for binary in ("ip", "setpriv"):
        if shutil.which(binary) is None:
            return f"`{binary}` is not installed"
    for path in (RABBIT_SERVER, REDIS_SERVER):
        if not os.path.exists(path):
            return f"{path} is not installed"
    try:
        pwd.getpwnam("rabbitmq")
    except KeyError:
        return "no rabbitmq user"
    probe = f"llmbh-probe-{uuid.uuid4().hex[:6]}"
    try:
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            return f"`ip netns add` fails: {done.stderr.strip()}"
        done = subprocess.run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], capture_output=True,
                              text=True, timeout=10)
        if done.returncode != 0:
            return f"cannot create a bridge in a namespace: {done.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` unavailable: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def subnet_free(prefix: str = SUBNET) -> bool:
    """Whether the root namespace has no route into ``<prefix>.0/24`` (the harness never touches the root
    namespace, but a clash would confuse whoever reads addresses in logs)."""
    out = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    return not any(line.startswith(f"{prefix}.") for line in out.splitlines())


# -- threads inside a namespace --------------------------------------------------------------------------------
def enter_netns(ns: str) -> None:
    """Move the calling thread (only it, and threads it starts afterwards) into network namespace ``ns``."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class NetnsThread:
    """One thread living in a namespace; :meth:`call` runs a function on it (its sockets are that host's)."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{ns}", initializer=enter_netns,
                                        initargs=(ns,))

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 120, **kwargs: Any) -> T:
        return self._pool.submit(fn, *args, **kwargs).result(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return done


# -- the harness -------------------------------------------------------------------------------------------------
@dataclass
class Host:
    name: str
    ns: str  # its network namespace
    addr: str
    port: str  # its veth end on the bridge, in the switch namespace


@dataclass
class Proc:
    name: str
    host: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class Timings:
    network_s: float = 0.0
    rabbitmq_s: float = 0.0
    redis_s: float = 0.0
    processes_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Hosts:
    """Namespaces, bridge, services and processes of one system spread over hosts; see the module docstring.

    ``hosts``: the hosts besides ``svc`` and ``client`` (names from :data:`ADDRESSES`; ``api*``, ``batcher*``
    and ``gpu*`` get their process). ``env``: LLMB_* settings for every process (``sim_batch_ms=300`` ->
    ``LLMB_SIM_BATCH_MS=300``). ``logs``: where process logs (and the ledger's SQLite file) go; a temporary
    directory, removed at close, when omitted. ``web_workers``: gunicorn processes per API host.
    """

    def __init__(self, hosts: Iterable[str] = DEFAULT_HOSTS, *, logs: Path | None = None, web_workers: int = 1,
                 rabbit_heartbeat_s: int | None = None, **env: object) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.namespace = "h" + self.tag  # LLMB_NAMESPACE: queues and keys of this harness only
        self.hosts: dict[str, Host] = {}
        for name in ("svc", "client", *hosts):
            if name not in ADDRESSES:
                raise ValueError(f"unknown host {name!r}; known: {sorted(ADDRESSES)}")
            self.hosts[name] = Host(name, f"llmbh-{self.tag}-{name}", f"{SUBNET}.{ADDRESSES[name]}",
                                    f"to-{name}"[:15])
        self.switch = f"llmbh-{self.tag}-sw"
        self.own_logs = logs is None
        self.logs = Path(tempfile.mkdtemp(prefix=f"llmbh-{self.tag}-logs-")) if logs is None else logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rabbit_dir = Path(tempfile.mkdtemp(prefix=f"llmbh-{self.tag}-rabbit-", dir="/tmp"))
        self.node = f"llmbh{self.tag}@localhost"
        self.rabbit_heartbeat_s = rabbit_heartbeat_s  # the node's own heartbeat proposal (None: RabbitMQ's 60 s)
        self.web_workers = web_workers
        svc = self.hosts["svc"].addr
        self.broker_url = f"amqp://guest:guest@{svc}:{AMQP_PORT}//"
        self.redis_url = f"redis://{svc}:{REDIS_PORT}/0"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("LLMB_")},
                    "LLMB_NAMESPACE": self.namespace, "LLMB_BROKER_URL": self.broker_url,
                    "LLMB_REDIS_URL": self.redis_url, "LLMB_DATABASE_URL": f"sqlite:///{self.logs / 'ledger.db'}",
                    "LLMB_AUTH": "none", "PYTHONUNBUFFERED": "1"}
        self.env.update({f"LLMB_{k.upper()}": str(v) for k, v in env.items()})
        self.procs: dict[str, Proc] = {}
        self.cut_hosts: set[str] = set()
        self.timings = Timings()
        self._client: NetnsThread | None = None
        self._redis: redis.Redis | None = None
        self._closed = False
        self._made: list[str] = []  # namespaces created, in order
        atexit.register(self.close)

    # -- names -------------------------------------------------------------------------------------------------
    def addr(self, host: str) -> str:
        return self.hosts[host].addr

    def url(self, host: str = "api") -> str:
        return f"http://{self.addr(host)}:{WEB_PORT}"

    def host_of_addr(self, addr: str) -> str | None:
        return next((h.name for h in self.hosts.values() if h.addr == addr), None)

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
        if not subnet_free():
            raise RuntimeError(f"{SUBNET}.0/24 is routed in the root namespace; change tests.netns.SUBNET")
        sw = self.switch
        run("ip", "netns", "add", sw)
        self._made.append(sw)
        run("ip", "-n", sw, "link", "set", "lo", "up")
        run("ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        run("ip", "-n", sw, "link", "set", "br0", "up")
        for host in self.hosts.values():
            run("ip", "netns", "add", host.ns)
            self._made.append(host.ns)
            run("ip", "-n", host.ns, "link", "add", "eth0", "type", "veth", "peer", "name", host.port, "netns", sw)
            run("ip", "-n", sw, "link", "set", host.port, "master", "br0")
            run("ip", "-n", sw, "link", "set", host.port, "up")
            run("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            run("ip", "-n", host.ns, "link", "set", "eth0", "up")
            run("ip", "-n", host.ns, "link", "set", "lo", "up")

    def start_services(self) -> None:
        t0 = time.monotonic()
        self._start_rabbit()
        self._start_redis()
        wait_for(self._redis_up, 20, f"the private Redis on {self.redis_url}")
        self.timings.redis_s = time.monotonic() - t0
        try:
            wait_for(self._rabbit_up, 90, f"the private RabbitMQ node {self.node} on {self.broker_url}")
        except TimeoutError:
            raise TimeoutError("the private RabbitMQ node did not start:\n"
                               + self._tail(self.rabbit_dir / "server.out")) from None
        self.timings.rabbitmq_s = time.monotonic() - t0

    def _start_rabbit(self) -> None:
        d, svc = self.rabbit_dir, self.hosts["svc"]
        conf = f"listeners.tcp.default = {svc.addr}:{AMQP_PORT}\nloopback_users = none\n"
        if self.rabbit_heartbeat_s is not None:
            conf += f"heartbeat = {self.rabbit_heartbeat_s}\n"
        (d / "rabbitmq.conf").write_text(conf)
        (d / "enabled_plugins").write_text("[].\n")
        (d / "rabbitmq-env.conf").write_text("")  # not the machine's, which names the shared node
        user = pwd.getpwnam("rabbitmq")
        for path in [d, *d.iterdir()]:
            os.chown(path, user.pw_uid, user.pw_gid)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": user.pw_dir, "LANG": "C.UTF-8",
            "RABBITMQ_NODENAME": self.node, "RABBITMQ_NODE_IP_ADDRESS": svc.addr,
            "RABBITMQ_NODE_PORT": str(AMQP_PORT), "RABBITMQ_DIST_PORT": "25672",
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"), "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"), "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(d / "feature_flags"), "RABBITMQ_PID_FILE": str(d / "node.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            # distribution and epmd on svc's own loopback: its epmd is the namespace's, colliding with nobody
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }
        argv = ["ip", "netns", "exec", svc.ns, "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                "--init-groups", RABBIT_SERVER]
        log = open(d / "server.out", "ab")
        popen = subprocess.Popen(argv, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs["rabbitmq"] = Proc("rabbitmq", "svc", popen, d / "server.out")

    def _start_redis(self) -> None:
        svc = self.hosts["svc"]
        argv = ["ip", "netns", "exec", svc.ns, REDIS_SERVER, "--bind", svc.addr, "--port", str(REDIS_PORT),
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.rabbit_dir)]
        log_path = self.logs / "redis.log"
        popen = subprocess.Popen(argv, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs["redis"] = Proc("redis", "svc", popen, log_path)

    def _rabbit_up(self) -> bool:
        proc = self.procs["rabbitmq"].popen
        if proc.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited with {proc.returncode}:\n"
                               + self._tail(self.rabbit_dir / "server.out"))

        def connect() -> bool:
            try:
                with Connection(self.broker_url, connect_timeout=1) as conn:
                    conn.connect()
                    return True
            except Exception:
                return False

        return self.on_client(connect)

    def _redis_up(self) -> bool:
        def ping() -> bool:
            try:
                return bool(redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1).ping())
            except redis.RedisError:
                return False

        return self.on_client(ping)

    # -- processes ---------------------------------------------------------------------------------------------
    def spawn(self, name: str, host: str, argv: list[str], raw_env: dict[str, str] | None = None,
              **env: object) -> Proc:
        """Start ``argv`` on ``host`` (``ip netns exec``) as ``name``, in a process group of its own; ``env``:
        LLMB_* settings of this process only."""
        extra = {f"LLMB_{k.upper()}": str(v) for k, v in env.items()} | (raw_env or {})
        log_path = self.logs / f"{name}.log"
        log = open(log_path, "ab")
        popen = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *argv], cwd=ROOT,
                                 env={**self.env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.procs[name] = Proc(name, host, popen, log_path)
        return self.procs[name]

    def start(self, host: str, **env: object) -> Proc | None:
        """Start ``host``'s process (the process named after its host); None for svc and client."""
        if host.startswith("gpu"):
            return self.spawn(host, host, [str(BIN / "gpu-worker"), "--gpu", "0", "--host", host, "--backend", "sim"],
                              **env)
        if host.startswith("batcher"):
            return self.spawn(host, host, [str(BIN / "llmb-batcher"), "--hostname", f"{host}.{self.namespace}@{host}"],
                              **env)
        if host.startswith("api"):
            env = {"web_bind": f"{self.addr(host)}:{WEB_PORT}", "web_workers": self.web_workers, **env}
            return self.spawn(host, host, [str(BIN / "gunicorn"), "-c", "webapp/gunicorn_conf.py",
                                           "webapp:create_app()"],
                              raw_env={"PROMETHEUS_MULTIPROC_DIR": str(self.logs / f"metrics-{host}")}, **env)
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
        from tests.stack import children_of
        return children_of(self.procs[name].popen.pid)

    def log(self, name: str) -> str:
        proc = self.procs.get(name)
        path = proc.log if proc is not None else self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @staticmethod
    def _tail(path: Path, n: int = 3000) -> str:
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def admin(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``llmb-admin`` run on the client host against this system."""
        done = subprocess.run(["ip", "netns", "exec", self.hosts["client"].ns, str(BIN / "llmb-admin"), *args],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"llmb-admin {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout}\n{done.stderr}")
        return done

    # -- links -------------------------------------------------------------------------------------------------
    def cut(self, host: str) -> float:
        """Pull ``host``'s cable (its bridge port down: packets dropped silently both ways); time.monotonic()."""
        run("ip", "-n", self.switch, "link", "set", self.hosts[host].port, "down")
        self.cut_hosts.add(host)
        return time.monotonic()

    def restore(self, host: str) -> float:
        run("ip", "-n", self.switch, "link", "set", self.hosts[host].port, "up")
        self.cut_hosts.discard(host)
        return time.monotonic()

    def restore_all(self) -> None:
        for host in list(self.cut_hosts):
            self.restore(host)

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
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def fresh(self, host: str, stale_s: float | None = None) -> bool:
        """Whether ``host``'s worker has heartbeated (idle or busy) within the stale time."""
        stale = self.heartbeat_stale_s if stale_s is None else stale_s
        beat = self.fleet().get(self.worker_id(host))
        return bool(beat) and time.time() - float(beat["heartbeat_at"]) < stale and beat["state"] in ("idle", "busy")

    @property
    def heartbeat_stale_s(self) -> float:
        return float(self.env.get("LLMB_HEARTBEAT_INTERVAL_S", 1.0)) * float(
            self.env.get("LLMB_HEARTBEAT_STALE_FACTOR", 3.0))

    def inflight(self) -> int:
        """Items admitted and not yet answered, across every API process (the admission set)."""
        return int(self.redis(lambda r: r.zcard(f"{self.namespace}:inflight")))

    def leases(self) -> dict[str, float]:
        """API processes' admission leases: instance -> seconds until expiry (Redis's clock)."""
        def read(r: redis.Redis) -> tuple[list[tuple[bytes, float]], Any]:
            return r.zrange(f"{self.namespace}:inflight:instances", 0, -1, withscores=True), r.time()
        members, (sec, usec) = self.redis(read)
        now = sec + usec / 1e6
        return {m.decode(): score - now for m, score in members}

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
        done = subprocess.run(["ip", "netns", "exec", self.hosts["svc"].ns, RABBITMQCTL, "-n", self.node, *args],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done.stdout

    def connections(self) -> list[dict[str, str]]:
        """The node's client connections: host (by peer address), heartbeat timeout (s), client name."""
        out = self.rabbitmqctl("list_connections", "-s", "peer_host", "timeout", "name", "state")
        rows = []
        for line in out.splitlines():
            parts = line.split("\t")
            if len(parts) >= 4:
                rows.append({"host": self.host_of_addr(parts[0]) or parts[0], "heartbeat_s": parts[1],
                             "name": parts[2], "state": parts[3]})
        return rows

    def active_batcher(self) -> str | None:
        """The batcher host RabbitMQ delivers requests to now (single active consumer), or None."""
        consumers = self.rabbitmqctl("list_consumers", "-s", "queue_name", "channel_pid", "active", "activity_status")
        channels = self.rabbitmqctl("list_channels", "-s", "pid", "name")
        name_of = {}
        for line in channels.splitlines():
            parts = line.split("\t")
            if len(parts) >= 2:
                name_of[parts[0]] = parts[1]
        for line in consumers.splitlines():
            parts = line.split("\t")
            if len(parts) >= 4 and parts[0] == self.request_queue and parts[2] == "true" \
                    and parts[3] == "single_active":
                peer = name_of.get(parts[1], "").split(":", 1)[0]
                return self.host_of_addr(peer)
        return None

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
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{self._tail(proc.log)}")
        wait_for(lambda: all(self.fresh(h) for h in gpus), timeout_s, f"fresh heartbeats from {gpus}")
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
        for ns in reversed(self._made):  # whatever else lives in a namespace of ours (epmd, orphans)
            self.kill_namespace(ns)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        self.procs.clear()
        if self._client is not None:
            self._client.close()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
        shutil.rmtree(self.rabbit_dir, ignore_errors=True)
        if self.own_logs:
            shutil.rmtree(self.logs, ignore_errors=True)
        atexit.unregister(self.close)

    @staticmethod
    def kill_namespace(ns: str) -> None:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        for pid in pids:
            if int(pid) != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)


# -- measurements ----------------------------------------------------------------------------------------------
class OutstandingSampler:
    """Samples, from the client host, the batches outstanding on each worker: ready in its queue plus those it
    holds (unacknowledged). RabbitMQ leaves a message ready only while its consumer's prefetch (``prefetch``,
    LLMB_MAX_OUTSTANDING_BATCHES) is full, so outstanding = ready + prefetch when ready > 0 (in two samples
    running, so that a message caught on its way to a consumer with room does not count), else what the
    worker's last heartbeat reports holding; with no consumer (its connection closed) it is what is ready.
    Only workers in the pool count (a fresh heartbeat): a cut-off worker's queue is the batchers' to take back.
    Passive declares every ``interval_s`` (cheap), heartbeats every fourth sample."""

    def __init__(self, hosts: Hosts, interval_s: float = 0.05, prefetch: int = 2) -> None:
        self.h = hosts
        self.interval_s = interval_s
        self.prefetch = prefetch
        self.max_outstanding: dict[str, int] = {}
        self.max_ready: dict[str, int] = {}
        self.max_at: dict[str, float] = {}  # seconds after the start when each maximum was first seen
        self.started_at = time.monotonic()
        self.samples = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outstanding-sampler", daemon=True)

    def __enter__(self) -> OutstandingSampler:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        enter_netns(self.h.hosts["client"].ns)
        client = redis.Redis.from_url(self.h.redis_url, socket_timeout=1, socket_connect_timeout=1)
        held: dict[str, int] = {}
        fresh: dict[str, bool] = {}
        last_ready: dict[str, int] = {}
        conn: Connection | None = None
        n = 0
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = Connection(self.h.broker_url, connect_timeout=1)
                    conn.connect()
                channel = conn.default_channel
                if n % 4 == 0:
                    now = time.time()
                    for wid, raw in client.hgetall(f"{self.h.namespace}:fleet").items():
                        beat, host = json.loads(raw), wid.decode().split("@", 1)[1]
                        held[host] = int(beat.get("outstanding") or 0)
                        fresh[host] = now - float(beat.get("heartbeat_at") or 0) < self.h.heartbeat_stale_s
                for host in self.h.gpu_hosts:
                    _, ready, consumers = channel.queue_declare(self.h.gpu_queue(host), passive=True)
                    if not fresh.get(host):  # out of the pool (cut off, say): nobody sends it anything
                        continue
                    # ready in two samples running: a message caught between its enqueue and its delivery to a
                    # consumer with room is not waiting (a batch beyond the prefetch waits a whole batch time)
                    waiting, last_ready[host] = min(int(ready), last_ready.get(host, 0)), int(ready)
                    if not consumers:  # its connection is gone: what it held is back in the queue, ready
                        out = waiting
                    else:
                        out = waiting + self.prefetch if waiting else held.get(host, 0)
                    if out > self.max_outstanding.get(host, -1):
                        self.max_outstanding[host] = out
                        self.max_at[host] = round(time.monotonic() - self.started_at, 2)
                    self.max_ready[host] = max(self.max_ready.get(host, 0), waiting)
                self.samples += 1
            except Exception:
                self.errors += 1
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.release()
                conn = None
            n += 1
            self._stop.wait(self.interval_s)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.release()


@contextlib.contextmanager
def hosts(**kwargs: Any) -> Iterator[Hosts]:
    """``with hosts(...) as h:`` the same as ``with Hosts(...) as h:``."""
    with Hosts(**kwargs) as h:
        yield h


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


# -- scenarios: run by tests/test_hosts.py (which asserts) and bench/hosts.py (which prints) --------------------
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
            wait_for(lambda: h.fresh(host), 30, f"{wid} heartbeating again")
            rejoined = time.monotonic() - restored_at
            done0 = int(h.fleet()[wid].get("completed") or 0)
            wait_for(lambda: int(h.fleet()[wid].get("completed") or 0) >= done0 + 3
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
            return {m.decode(): (score, [k.decode() for k in r.hkeys(f"{ns}:inflight:owner:{m.decode()}")])
                    for m, score in r.zrange(f"{ns}:inflight:instances", 0, -1, withscores=True)}

        snapshot = h.redis(leases_and_owners)  # the cut processes can change nothing of theirs from now on

        def held() -> tuple[int, int, int]:
            """(items the cut host's processes had admitted at the cut, those still admitted, their leases
            reaped)."""
            def read(r: redis.Redis) -> tuple[int, int, int]:
                live = {m.decode(): s for m, s in r.zrange(f"{ns}:inflight:instances", 0, -1, withscores=True)}
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
    try:
        wait_for(lambda: h.inflight() == 0, 10, "admission to empty after the loads")
    except TimeoutError:
        pass
    return ApiCut(victim, report, other_report, held_at_cut, released, still, reaped, resumed, h.inflight(),
                  timeout_ms, h.redis(lambda r: admitted_items(r, ns)))


def admitted_items(r: redis.Redis, ns: str) -> list[tuple[str, float, str | None]]:
    """Every item in the admission set: (id, seconds to its deadline on Redis's clock, the API process
    instance whose owner hash holds it, if any)."""
    sec, usec = r.time()
    now = sec + usec / 1e6
    owners = [k.decode() for k in r.scan_iter(f"{ns}:inflight:owner:*")]
    out = []
    for member, score in r.zrange(f"{ns}:inflight", 0, -1, withscores=True):
        owner = next((o.rsplit(":", 1)[1] for o in owners if r.hexists(o, member)), None)
        out.append((member.decode(), round(score - now, 1), owner))
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
    from tests.loadgen import report_of

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
