"""The ``svc`` host of the multi-host harness: a private RabbitMQ node (own node name, epmd, data and logs; AMQP on
``<svc>:5672``) and a private Redis (``<svc>:6379``), each bound to svc's bridge address, and what rabbitmqctl
says of the node's connections and consumers.

Both are started with ``ip netns exec`` in svc's namespace; everyone else reaches them only over the bridge.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from kombu import Connection

from harness.netns.topology import AMQP_PORT, REDIS_PORT, Network, Proc, tail
from harness.services import rabbit_node_files
from harness.stack import wait_for

RABBIT_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # the real script; /usr/sbin's wrapper su's and logs away
RABBITMQCTL = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

OnClient = Callable[[Callable[[], bool]], bool]  # runs a probe on a thread of the client host


def servers_unavailable() -> str | None:
    """Why the svc host's servers cannot run here (None: they can): setpriv, the servers, the rabbitmq user."""
    if shutil.which("setpriv") is None:
        return "`setpriv` is not installed"
    for path in (RABBIT_SERVER, REDIS_SERVER):
        if not os.path.exists(path):
            return f"{path} is not installed"
    try:
        pwd.getpwnam("rabbitmq")
    except KeyError:
        return "no rabbitmq user"
    return None


class ServiceHost:
    """RabbitMQ and Redis on ``net``'s svc host. ``logs``: where Redis's log goes (RabbitMQ's data and logs live
    in a temporary directory of their own, :attr:`rabbit_dir`, removed by :meth:`remove`); ``heartbeat_s``: the
    node's own heartbeat proposal (None: RabbitMQ's 60 s); ``on_client``: runs the readiness probes from the
    client host."""

    def __init__(self, net: Network, tag: str, logs: Path, heartbeat_s: int | None, on_client: OnClient) -> None:
        self.net = net
        self.svc = net.hosts["svc"]
        self.logs = logs
        self.rabbit_dir = Path(tempfile.mkdtemp(prefix=f"llmbh-{tag}-rabbit-", dir="/tmp"))
        self.node = f"llmbh{tag}@localhost"
        self.heartbeat_s = heartbeat_s
        self.on_client = on_client
        self.broker_url = f"amqp://guest:guest@{self.svc.addr}:{AMQP_PORT}//"
        self.redis_url = f"redis://{self.svc.addr}:{REDIS_PORT}/0"

    def start(self, procs: dict[str, Proc]) -> tuple[float, float]:
        """Start both (into ``procs``, as ``rabbitmq`` and ``redis``) and wait until the client host reaches
        each; the seconds each took to answer (Redis, RabbitMQ), both from the start."""
        t0 = time.monotonic()
        procs["rabbitmq"] = self._start_rabbit()
        procs["redis"] = self._start_redis()
        wait_for(self._redis_up, 20, f"the private Redis on {self.redis_url}")
        redis_s = time.monotonic() - t0
        try:
            wait_for(lambda: self._rabbit_up(procs["rabbitmq"]), 90,
                     f"the private RabbitMQ node {self.node} on {self.broker_url}")
        except TimeoutError:
            raise TimeoutError("the private RabbitMQ node did not start:\n"
                               + tail(self.rabbit_dir / "server.out")) from None
        return redis_s, time.monotonic() - t0

    def _start_rabbit(self) -> Proc:
        d, svc = self.rabbit_dir, self.svc
        user, env = rabbit_node_files(d, self.node, f"{svc.addr}:{AMQP_PORT}", heartbeat_s=self.heartbeat_s)
        # distribution and epmd on svc's own loopback: its epmd is the namespace's, colliding with nobody
        env.update(RABBITMQ_NODE_IP_ADDRESS=svc.addr, RABBITMQ_NODE_PORT=str(AMQP_PORT), RABBITMQ_DIST_PORT="25672",
                   ERL_EPMD_ADDRESS="127.0.0.1")
        argv = ["ip", "netns", "exec", svc.ns, "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                "--init-groups", RABBIT_SERVER]
        with open(d / "server.out", "ab") as log:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(argv, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return Proc("rabbitmq", "svc", popen, d / "server.out")

    def _start_redis(self) -> Proc:
        svc = self.svc
        argv = ["ip", "netns", "exec", svc.ns, REDIS_SERVER, "--bind", svc.addr, "--port", str(REDIS_PORT),
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.rabbit_dir)]
        log_path = self.logs / "redis.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return Proc("redis", "svc", popen, log_path)

    def _rabbit_up(self, proc: Proc) -> bool:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited with {proc.popen.returncode}:\n"
                               + tail(self.rabbit_dir / "server.out"))

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

    # -- what the node says ------------------------------------------------------------------------------------
    def rabbitmqctl(self, *args: str, timeout: float = 60) -> str:
        """rabbitmqctl against the private node, run on svc (where its epmd is)."""
        done = subprocess.run(["ip", "netns", "exec", self.svc.ns, RABBITMQCTL, "-n", self.node, *args],
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
                rows.append({"host": self.net.host_of_addr(parts[0]) or parts[0], "heartbeat_s": parts[1],
                             "name": parts[2], "state": parts[3]})
        return rows

    def active_consumer(self, queue: str) -> str | None:
        """The host RabbitMQ delivers ``queue``'s messages to now (its single active consumer), or None."""
        consumers = self.rabbitmqctl("list_consumers", "-s", "queue_name", "channel_pid", "active", "activity_status")
        channels = self.rabbitmqctl("list_channels", "-s", "pid", "name")
        name_of = {}
        for line in channels.splitlines():
            parts = line.split("\t")
            if len(parts) >= 2:
                name_of[parts[0]] = parts[1]
        for line in consumers.splitlines():
            parts = line.split("\t")
            if len(parts) >= 4 and parts[0] == queue and parts[2] == "true" and parts[3] == "single_active":
                peer = name_of.get(parts[1], "").split(":", 1)[0]
                return self.net.host_of_addr(peer)
        return None

    def remove(self) -> None:
        """The node's data and logs go (once it is dead)."""
        shutil.rmtree(self.rabbit_dir, ignore_errors=True)

