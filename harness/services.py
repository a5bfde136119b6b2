"""Services of a test's own, for fault tests that must not disturb anything shared.

- :class:`PrivateRedis`: a redis-server on a free port that a test may kill (SIGKILL) and restart.
- :class:`Vhost`: a RabbitMQ virtual host of the shared broker, whose connections (and only those) a test may
  cut; deleted at the end.
- :class:`PrivateRabbit`: a RabbitMQ node of its own (memory and disk alarms are node-wide, so they are never
  raised on the shared broker). Starting one takes ~5-15 s, so it is a session fixture shared by every test
  that needs it, and stopped at the end of the session (also at interpreter exit, should a finaliser not run).

Fixtures: ``private_redis``, ``own_vhost``, ``private_rabbit`` (session) and ``rabbit`` (that node, with every
alarm cleared after each test). Import them into a test module to use them.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from kombu import Connection

from harness.stack import free_port, wait_for

RABBITMQCTL = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
RABBIT_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # the real script; /usr/sbin's wrapper su's and logs away
SHARED_AMQP = "amqp://guest:guest@127.0.0.1:5672"


def rabbitmqctl(*args: str, node: str | None = None, timeout: float = 60,
                check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [RABBITMQCTL, *(["-n", node] if node else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return done


# -- Redis -------------------------------------------------------------------------------------------------------
class PrivateRedis:
    """A redis-server of the test's own; ``kill()`` is SIGKILL, ``start()`` again reuses the same port."""

    def __init__(self, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.args = list(args)  # more redis-server options (``--replicaof``, ``--dir``, ...)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10) -> PrivateRedis:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", *self.args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_for(self.ping, timeout_s, f"the private Redis on port {self.port}")
        return self

    def ping(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- a vhost of the shared broker ---------------------------------------------------------------------------------
class Vhost:
    """A vhost on the shared RabbitMQ; cutting its connections touches no other vhost's."""

    def __init__(self) -> None:
        self.name = "llmbt-" + uuid.uuid4().hex[:10]

    @property
    def url(self) -> str:
        return f"{SHARED_AMQP}/{self.name}"

    @staticmethod
    def available() -> bool:
        """Can this process manage vhosts (rabbitmqctl present and allowed)? The benchmark asks; tests need it."""
        try:
            return rabbitmqctl("list_vhosts", check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def create(self) -> Vhost:
        rabbitmqctl("add_vhost", self.name)
        rabbitmqctl("set_permissions", "-p", self.name, "guest", ".*", ".*", ".*")
        return self

    def connections(self) -> list[str]:
        """Pids of this vhost's client connections, as rabbitmqctl names them."""
        out = rabbitmqctl("list_connections", "-s", "pid", "vhost").stdout
        pids = []
        for line in out.splitlines():
            parts = line.strip().split("\t")
            if len(parts) == 2 and parts[1] == self.name:
                pids.append(parts[0])
        return pids

    def close_connections(self, reason: str = "fault test") -> int:
        """Close every client connection of this vhost at once (and no other vhost's); returns how many."""
        count = len(self.connections())
        if count:
            rabbitmqctl("close_all_connections", "-p", self.name, reason)
        return count

    def delete(self) -> None:
        rabbitmqctl("delete_vhost", self.name, check=False)  # closes whatever is still connected to it


@pytest.fixture
def own_vhost() -> Iterator[Vhost]:
    vhost = Vhost()
    vhost.create()
    try:
        yield vhost
    finally:
        vhost.delete()


# -- a RabbitMQ node of our own -----------------------------------------------------------------------------------
def rabbit_node_files(d: Path, node: str, listener: str, *, heartbeat_s: float | None = None
                      ) -> tuple[pwd.struct_passwd, dict[str, str]]:
    """Write a private RabbitMQ node's files into ``d`` (AMQP on ``listener``, ``host:port``), owned by the rabbitmq
    user, and return that user and the node's environment: its own config, data, logs, pid and feature-flag
    files (none of the machine's), distribution on loopback. The caller adds its ports and epmd."""
    conf = f"listeners.tcp.default = {listener}\nloopback_users = none\n"
    if heartbeat_s is not None:
        conf += f"heartbeat = {heartbeat_s}\n"
    (d / "rabbitmq.conf").write_text(conf)
    (d / "enabled_plugins").write_text("[].\n")
    (d / "rabbitmq-env.conf").write_text("")  # not the machine's, which names the shared node
    user = pwd.getpwnam("rabbitmq")
    for path in [d, *d.iterdir()]:
        os.chown(path, user.pw_uid, user.pw_gid)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": user.pw_dir, "LANG": "C.UTF-8",
        "RABBITMQ_NODENAME": node, "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
        "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
        "RABBITMQ_MNESIA_BASE": str(d / "mnesia"), "RABBITMQ_LOG_BASE": str(d / "log"),
        "RABBITMQ_FEATURE_FLAGS_FILE": str(d / "feature_flags"), "RABBITMQ_PID_FILE": str(d / "node.pid"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
    }
    return user, env


class PrivateRabbit:
    """A RabbitMQ node of its own (own node name, AMQP and distribution ports, data, logs), run as the rabbitmq
    user with the shared epmd; its alarms concern nobody else."""

    def __init__(self) -> None:
        self.node = f"llmbt{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="llmb-rabbit-", dir="/tmp"))  # pytest's tmp is root-only
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout_s: float = 60) -> None:
        d = self.dir
        user, env = rabbit_node_files(d, self.node, f"127.0.0.1:{self.port}")
        env.update(RABBITMQ_DIST_PORT=str(self.dist_port),
                   ERL_EPMD_ADDRESS="127.0.0.1")  # the shared epmd answers; if none runs, the one started stays local
        with open(d / "server.out", "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([RABBIT_SERVER], cwd=d, env=env, user=user.pw_uid, group=user.pw_gid,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop)  # should the session's finaliser never run
        try:
            wait_for(self._ready, timeout_s, f"the private RabbitMQ node {self.node}")
        except TimeoutError:
            tail = (d / "server.out").read_text(errors="replace")[-3000:]
            self.stop()
            raise TimeoutError(f"the private RabbitMQ node did not start:\n{tail}") from None

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited with {self.proc.returncode}: "
                               + (self.dir / "server.out").read_text(errors="replace")[-3000:])
        try:
            with Connection(self.url, connect_timeout=1) as conn:
                conn.connect()
                return True
        except Exception:
            return False

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return rabbitmqctl(*args, node=self.node, check=check)

    # -- alarms ---------------------------------------------------------------------------------------------
    def raise_memory_alarm(self) -> None:
        self.ctl("set_vm_memory_high_watermark", "0.0000001")

    def raise_disk_alarm(self) -> None:
        self.ctl("set_disk_free_limit", "100000GB")

    def clear_alarms(self) -> None:
        self.ctl("set_vm_memory_high_watermark", "0.4")
        self.ctl("set_disk_free_limit", "50MB")

    def alarms(self) -> list[str]:
        """The node's alarms, e.g. ['Memory alarm on node ...']; empty when none."""
        out = self.ctl("status").stdout
        section = out.split("Alarms", 1)[1].split("\n\n", 2)[1] if "Alarms" in out else ""
        return [line.strip() for line in section.splitlines() if line.strip() and line.strip() != "(none)"]

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            self.ctl("stop", check=False)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        # anything of the node's process group still about (the beam, its port programs)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)


@pytest.fixture(scope="session")
def private_rabbit() -> Iterator[PrivateRabbit]:
    node = PrivateRabbit()
    try:
        node.start()
        yield node
    finally:
        node.stop()


@pytest.fixture
def rabbit(private_rabbit: PrivateRabbit) -> Iterator[PrivateRabbit]:
    """The private node, with no alarm at the start and none left behind by the test."""
    private_rabbit.clear_alarms()
    try:
        yield private_rabbit
    finally:
        private_rabbit.clear_alarms()
        wait_for(lambda: not private_rabbit.alarms(), 20, "the private node's alarms to clear")

