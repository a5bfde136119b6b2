"""The network of the multi-host harness: one Linux network namespace per host, joined by a bridge, cables to pull.

Topology (10.213.0.0/24 unless :data:`SUBNET` is changed; every namespace is the harness's own, named
``llmbh-<tag>-<host>``):

- ``sw``: the switch, a namespace holding only the bridge ``br0`` and one veth end per host (``to-<host>``);
  nothing touches the root namespace's interfaces or routes;
- one namespace per host of :data:`ADDRESSES`, its ``eth0`` on the bridge at ``<SUBNET>.<octet>``.

**Cutting a host** is ``ip link set to-<host> down`` on the bridge side: the host's end loses its carrier and
every packet it sends, or that is sent to it, is dropped without a word (no RST, no FIN): a pulled cable.
Connections stay open on both sides until a timeout (TCP retransmissions, AMQP heartbeats) gives up; once
ARP gives up, new connects to or from the host fail with "no route to host", as on a real LAN.

A network namespace is per thread on Linux, and threads a thread starts inherit it: :class:`NetnsThread` is a
thread that entered a host's namespace with ``setns``, so the sockets it opens are that host's.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SUBNET = "10.213.0"  # /24, private to the harness's namespaces (checked against the root namespace's routes)
AMQP_PORT, REDIS_PORT, WEB_PORT = 5672, 6379, 8000
CLONE_NEWNET = 0x40000000

# host -> last octet of its address
ADDRESSES = {"svc": 2, "api": 3, "api2": 4, "batcher1": 5, "batcher2": 6, "gpu1": 7, "gpu2": 8, "gpu3": 9,
             "client": 20}
DEFAULT_HOSTS = ("api", "batcher1", "batcher2", "gpu1", "gpu2")

_libc = ctypes.CDLL(None, use_errno=True)


def netns_unavailable() -> str | None:
    """Why this machine cannot build the network (None: it can): root, ``ip``, a namespace with a bridge in it."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "`ip` is not installed"
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


def tail(path: Path, n: int = 3000) -> str:
    """The end of a log file ('' when there is none yet)."""
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


# -- hosts and their processes ---------------------------------------------------------------------------------
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


class Network:
    """The switch and one namespace per host of ``names`` (from :data:`ADDRESSES`), their cables, their removal.

    Nothing exists until :meth:`build`; :meth:`delete` removes whatever was made, in reverse order."""

    def __init__(self, tag: str, names: Iterable[str]) -> None:
        self.hosts: dict[str, Host] = {}
        for name in names:
            if name not in ADDRESSES:
                raise ValueError(f"unknown host {name!r}; known: {sorted(ADDRESSES)}")
            self.hosts[name] = Host(name, f"llmbh-{tag}-{name}", f"{SUBNET}.{ADDRESSES[name]}", f"to-{name}"[:15])
        self.switch = f"llmbh-{tag}-sw"
        self.cut_hosts: set[str] = set()
        self.made: list[str] = []  # namespaces created, in order

    def host_of_addr(self, addr: str) -> str | None:
        return next((h.name for h in self.hosts.values() if h.addr == addr), None)

    def build(self) -> None:
        if not subnet_free():
            raise RuntimeError(f"{SUBNET}.0/24 is routed in the root namespace; change "
                               "harness.netns.topology.SUBNET")
        sw = self.switch
        run("ip", "netns", "add", sw)
        self.made.append(sw)
        run("ip", "-n", sw, "link", "set", "lo", "up")
        run("ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        run("ip", "-n", sw, "link", "set", "br0", "up")
        for host in self.hosts.values():
            run("ip", "netns", "add", host.ns)
            self.made.append(host.ns)
            run("ip", "-n", host.ns, "link", "add", "eth0", "type", "veth", "peer", "name", host.port, "netns", sw)
            run("ip", "-n", sw, "link", "set", host.port, "master", "br0")
            run("ip", "-n", sw, "link", "set", host.port, "up")
            run("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            run("ip", "-n", host.ns, "link", "set", "eth0", "up")
            run("ip", "-n", host.ns, "link", "set", "lo", "up")

    # -- cables ------------------------------------------------------------------------------------------------
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

    # -- removal -----------------------------------------------------------------------------------------------
    def kill_everything(self) -> None:
        """SIGKILL whatever lives in a namespace of ours (epmd, orphans), newest namespace first."""
        for ns in reversed(self.made):
            self.kill_namespace(ns)

    def delete(self) -> None:
        """Delete every namespace made (and with them the bridge and veths)."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    @staticmethod
    def kill_namespace(ns: str) -> None:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        for pid in pids:
            if int(pid) != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
