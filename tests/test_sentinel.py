"""Redis behind Sentinel: the URL syntax, and the real system riding out a failover.

The fault tests run on a Sentinel set of their own (a master, one replica, three Sentinels, on free ports; the
shared Redis is not touched): the master is SIGKILLed, the Sentinels promote the replica, and every client
(redis-py's SentinelConnectionPool, through :func:`tasks.state.connect.redis_client`) finds the new master.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from harness.loadgen import SteadyLoad
from harness.services import PrivateRedis
from harness.stack import Stack, free_port, wait_for
from tasks.state.connect import (
    SENTINEL_PORT,
    PoolExhausted,
    SentinelWaitingPool,
    WaitingPool,
    parse_sentinel_url,
    redis_client,
)
from tasks.state.pubsub import Subscription
from tests.test_service_faults import describe, hold, sent_between, small_stack, wait_status

REDIS_SERVER = shutil.which("redis-server") or "redis-server"  # bin/test installs it where it is missing
SERVICE = "llmbtest"


# -- the URL ------------------------------------------------------------------------------------------------------
def test_a_sentinel_url_names_the_sentinels_the_service_the_db_and_the_credentials() -> None:
    url = ("redis+sentinel://app:s%40cret@10.0.0.1:26380,sentinel-b,[::1]:26381/cache/3"
           "?sentinel_password=sp&socket_timeout=1.5&health_check_interval=10")
    parsed = parse_sentinel_url(url)
    assert parsed.sentinels == (("10.0.0.1", 26380), ("sentinel-b", SENTINEL_PORT), ("::1", 26381))
    assert (parsed.service, parsed.db, parsed.username, parsed.password) == ("cache", 3, "app", "s@cret")
    assert (parsed.sentinel_username, parsed.sentinel_password) == (None, "sp")
    assert parsed.options == {"socket_timeout": 1.5, "health_check_interval": 10}
    bare = parse_sentinel_url("redis+sentinel://h1:26379,h2:26379,h3:26379/mymaster")
    assert (bare.service, bare.db, bare.username, bare.password) == ("mymaster", 0, None, None)
    assert parse_sentinel_url("redis+sentinel://:pw@h/m/0?db=2").password == "pw"
    assert parse_sentinel_url("redis+sentinel://:pw@h/m/0?db=2").db == 2


@pytest.mark.parametrize("url", [
    "redis+sentinel://h1:26379",  # no service
    "redis+sentinel://h1:26379/",  # no service
    "redis+sentinel:///mymaster",  # no Sentinel
    "redis+sentinel://h1:port/mymaster",  # bad port
    "redis+sentinel://h1/mymaster/zero",  # bad db
    "redis+sentinel://h1/mymaster/0/extra",
    "redis+sentinel://h1/mymaster?socket_timeout=soon",
    "redis://127.0.0.1:6379/0",  # not a Sentinel URL
])
def test_a_malformed_sentinel_url_is_refused_with_the_syntax(url: str) -> None:
    with pytest.raises(ValueError, match=r"redis|invalid"):
        parse_sentinel_url(url)


def test_redis_client_builds_the_pool_the_url_asks_for() -> None:
    """Nothing connects here: plain URLs get redis-py's own pools, Sentinel URLs its Sentinel pool (bounded
    when asked), with the servers' options on the pool and the socket options on the Sentinels too."""
    plain = redis_client("redis://127.0.0.1:6390/2", socket_timeout=5)
    assert type(plain.connection_pool) is redis.ConnectionPool
    assert plain.connection_pool.connection_kwargs["db"] == 2
    bounded = redis_client("redis://127.0.0.1:6390/0", max_connections=7, pool_timeout_s=1)
    assert isinstance(bounded.connection_pool, WaitingPool)
    assert (bounded.connection_pool.max_connections, bounded.connection_pool.timeout) == (7, 1)

    url = "redis+sentinel://:pw@127.0.0.1:26390,127.0.0.1:26391/svc/4?sentinel_password=sp"
    client = redis_client(url, socket_timeout=3, socket_connect_timeout=1)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and not isinstance(pool, SentinelWaitingPool)
    assert pool.service_name == "svc" and pool.is_master
    assert {k: pool.connection_kwargs[k] for k in ("db", "password", "socket_timeout")} == \
        {"db": 4, "password": "pw", "socket_timeout": 3}
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["port"], s.connection_pool.connection_kwargs["password"],
             s.connection_pool.connection_kwargs["socket_connect_timeout"]) for s in sentinels] == \
        [(26390, "sp", 1), (26391, "sp", 1)]
    waiting = redis_client(url, max_connections=3, pool_timeout_s=0.5).connection_pool
    assert isinstance(waiting, SentinelWaitingPool)
    assert (waiting.max_connections, waiting.timeout, waiting.service_name) == (3, 0.5, "svc")


# -- a Sentinel set of the test's own -----------------------------------------------------------------------------
class SentinelSet:
    """A master, one replica and three Sentinels (quorum 2) on free ports, in a temporary folder of its own."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="llmb-sentinel-"))
        self.master = PrivateRedis(args=["--dir", str(self.dir)])
        self.replica = PrivateRedis(args=["--dir", str(self.dir)])
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}/0"

    def start(self) -> SentinelSet:
        self.master.start()
        self.replica.args += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start()
        replica = redis.Redis(port=self.replica.port, socket_timeout=2)
        wait_for(lambda: replica.info("replication").get("master_link_status") == "up", 15, "the replica to sync")
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.dir}\nsentinel resolve-hostnames no\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                            f"sentinel failover-timeout {SERVICE} 5000\n"
                            f"sentinel parallel-syncs {SERVICE} 1\n")
            with open(self.dir / f"sentinel-{port}.log", "ab") as log:  # the child keeps its own copy
                self.sentinels.append(subprocess.Popen([str(REDIS_SERVER), str(conf), "--sentinel"], cwd=self.dir,
                                                       stdout=log, stderr=subprocess.STDOUT,
                                                       start_new_session=True))
        wait_for(self._settled, 30, "three Sentinels that see the master, its replica and each other")
        return self

    def _settled(self) -> bool:
        for port in self.sentinel_ports:
            state: dict[str, Any] = self._sentinel(port).sentinel_master(SERVICE)  # type: ignore[assignment]
            if state["num-slaves"] < 1 or state["num-other-sentinels"] < 2 or not state["is_master"]:
                return False
        return True

    @staticmethod
    def _sentinel(port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True)

    def master_port(self) -> int | None:
        """The master's port, as the Sentinels (the first that answers) name it now."""
        for port in self.sentinel_ports:
            try:
                address: Any = self._sentinel(port).sentinel_get_master_addr_by_name(SERVICE)
            except redis.RedisError:
                continue
            return int(address[1]) if address else None
        return None

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(self.dir.glob("sentinel-*.log")))

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        self.sentinels.clear()
        self.master.stop()
        self.replica.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class MasterWatch:
    """Notes when the Sentinels first name a master other than ``old`` (polled every 50 ms in a thread)."""

    def __init__(self, sentinels: SentinelSet, old: int) -> None:
        self.sentinels, self.old = sentinels, old
        self.switched_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="master-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            port = self.sentinels.master_port()
            if port is not None and port != self.old:
                self.switched_at = time.monotonic()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def sentinel_set() -> Iterator[SentinelSet]:
    found = SentinelSet()
    try:
        found.start()
        yield found
    finally:
        found.stop()


# -- clients, pub/sub and scripts across a failover -----------------------------------------------------------------
class _Done(Exception):
    """Raised in the subscription's thread to end it (its loop rides out only Redis errors)."""


@pytest.mark.fault
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # that _Done, on purpose
def test_a_sentinel_client_follows_the_master_with_its_bounded_pool_pubsub_and_scripts(
        sentinel_set: SentinelSet) -> None:
    client = redis_client(sentinel_set.url, max_connections=3, pool_timeout_s=0.2, socket_timeout=2,
                          socket_connect_timeout=1)
    client.set("k", "v")
    script = client.register_script("return redis.call('GET', KEYS[1])")
    assert script(keys=["k"]) == b"v"
    pool = client.connection_pool
    assert isinstance(pool, SentinelWaitingPool)
    held = [pool.get_connection() for _ in range(3)]
    with pytest.raises(PoolExhausted):  # the bound holds on the Sentinel pool too
        client.ping()
    for connection in held:
        pool.release(connection)

    got: list[bytes] = []
    subscribed: list[float] = []

    def on_message(data: bytes) -> None:
        if data == b"stop":
            raise _Done()
        got.append(data)

    Subscription(client, "chan", on_message, on_connect=lambda: subscribed.append(time.monotonic()),
                 name="test subscription").start()
    wait_for(lambda: client.publish("chan", "before") and b"before" in got, 10, "a message before the failover")
    assert client.wait(1, 2000) == 1  # the replica has everything written so far

    old = sentinel_set.master.port
    sentinel_set.master.kill()
    killed = time.monotonic()
    wait_for(lambda: sentinel_set.master_port() == sentinel_set.replica.port, 20,
             f"the Sentinels to promote the replica\n{sentinel_set.log()}")
    switched = time.monotonic()
    new = redis.Redis(port=sentinel_set.replica.port)
    new.script_flush()  # whatever was replicated: the client's script must reload itself (NOSCRIPT)
    wait_for(lambda: _answers(client), 10, "the client to reach the new master")
    resumed = time.monotonic()
    assert client.get("k") == b"v"
    assert script(keys=["k"]) == b"v"
    assert new.script_exists(script.sha) == [True], "the script was loaded again on the new master"
    assert pool.get_master_address() == ("127.0.0.1", sentinel_set.replica.port) != ("127.0.0.1", old)
    wait_for(lambda: len(subscribed) >= 2, 10, "the subscription to subscribe again, on the new master")
    wait_for(lambda: client.publish("chan", "after") and b"after" in got, 10, "a message after the failover")
    held = [pool.get_connection() for _ in range(2)]  # 3, less the subscription's
    with pytest.raises(PoolExhausted):  # the bound is intact after the failover: no slot leaked
        client.ping()
    for connection in held:
        pool.release(connection)
    assert len(pool._connections) <= 3, "connections to the old master are forgotten"
    client.publish("chan", "stop")
    wait_for(lambda: not any(t.name == "test subscription" for t in threading.enumerate()), 10,
             "the subscription's thread to end")
    print(f"\nsentinel client: switched {switched - killed:.1f} s after the kill, the client answered "
          f"{resumed - killed:.1f} s after it; resubscribed {subscribed[-1] - killed:.1f} s after it")


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


# -- the real system across a failover ------------------------------------------------------------------------------
RATE = 30.0  # requests/s
TIMEOUT_MS = 8000
RESUME_WITHIN_S = 10.0


@pytest.fixture
def sentinel_stack(tmp_path: Path, sentinel_set: SentinelSet) -> Iterator[Stack]:
    with small_stack(tmp_path, redis_url=sentinel_set.url) as stack:  # gunicorn, the batcher, one sim worker
        yield stack


@pytest.mark.fault
def test_master_sigkilled_under_load_fails_over_and_the_service_resumes_by_itself(
        sentinel_stack: Stack, sentinel_set: SentinelSet) -> None:
    stack = sentinel_stack
    old = sentinel_set.master.port
    assert sentinel_set.master_port() == old
    load = SteadyLoad(stack.url, RATE, timeout_ms=TIMEOUT_MS, prefix="sentinel").start()
    watch = MasterWatch(sentinel_set, old)
    try:
        wait_for(lambda: load.answered() >= 30, 15, "the load to flow")
        killed = time.monotonic()
        sentinel_set.master.kill()
        resumed, first = wait_status(stack.url, 200, RESUME_WITHIN_S, "a 200 after the failover")
        hold(load, load.sent, 4)
    finally:
        watch.stop()
        report = load.stop()
    new = redis.Redis(port=sentinel_set.replica.port, socket_timeout=2)
    channels = sorted(c.decode() if isinstance(c, bytes) else c for c in new.pubsub_channels(f"{stack.namespace}:*"))
    script_loads = new.info("commandstats").get("cmdstat_script|load", {}).get("calls", 0)
    in_flight = [o for o in report.outcomes if o.sent_at < killed < o.sent_at + o.latency_ms / 1000]
    switched = f"{watch.switched_at - killed:.1f} s" if watch.switched_at else "never"
    print(f"\nsentinel failover: {report.summary()}\n  error types {dict(report.error_types)}; in flight at the "
          f"kill: {describe(in_flight)}; Sentinels named the new master {switched} after the kill; first 200 "
          f"{resumed - killed:.1f} s after it ({first}); subscriptions on the new master {channels}; "
          f"SCRIPT LOADs there {script_loads}")
    assert sentinel_set.master_port() == sentinel_set.replica.port, "the replica was promoted"
    report.assert_sound(allow={200, 503, 504})
    assert resumed - killed < RESUME_WITHIN_S
    after = sent_between(report, resumed + 1, float("inf"))
    assert after and all(o.status == 200 for o in after), f"after resuming: {describe(after)}"
    assert f"{stack.namespace}:cancel" in channels, "the worker's subscription followed the master"
    assert any(c.startswith(f"{stack.namespace}:replies:") for c in channels), \
        "the API process's result listener followed the master"
