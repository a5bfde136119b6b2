"""Health checks' verdicts (pure): is a GPU worker's heartbeat fresh, and which process a container runs.

``llmb-admin health`` (:mod:`tasks.cli.health`) reads the heartbeat, the shared clock and PID 1's command line and
asks these; the container image's HEALTHCHECK and the Kubernetes probes run that command.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.schema import DRAINING, STARTING, WorkerInfo


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool
    why: str  # one line, printed by the check


def worker_id(device: int, host: str) -> str:
    """The id a worker gives itself in the fleet hash (gpu_worker: ``gpu<N>@<host>``)."""
    return f"gpu{device}@{host}"


def worker_verdict(wanted: str, worker: WorkerInfo | None, now: float, stale_after_s: float, *,
                   draining_ok: bool = False) -> HealthVerdict:
    """Healthy while ``wanted``'s heartbeat is at most ``stale_after_s`` old and it takes work: not starting (its
    consumer not consuming yet) nor stopping (draining: a drain ends with the process), either of which is not
    ready. ``draining_ok``: a liveness check, for which a starting or stopping worker still heartbeating is alive
    (it must not be killed while it starts or hands its work back)."""
    if worker is None:
        return HealthVerdict(False, f"{wanted}: no heartbeat in the fleet (not started, still loading its model, "
                                    "or gone)")
    age = now - worker.heartbeat_at
    if age > stale_after_s:
        return HealthVerdict(False, f"{wanted}: last heartbeat {age:.1f} s ago (stale after {stale_after_s:g} s)")
    if worker.state == DRAINING and not draining_ok:
        return HealthVerdict(False, f"{wanted}: draining (stopping, taking no more work)")
    if worker.state == STARTING and not draining_ok:
        return HealthVerdict(False, f"{wanted}: starting (its consumer is not consuming yet)")
    return HealthVerdict(True, f"{wanted}: {worker.state}, serving {worker.model}, heartbeat {max(0.0, age):.1f} s ago")


@dataclass(frozen=True)
class Process:
    """What a container's main process is: ``kind`` is web, worker, batcher, jobs, flower or other."""

    kind: str
    device: int = 0  # a worker's --gpu
    host: str | None = None  # a worker's --host, where given


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args`` (the last one given)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


INITS = frozenset({"catatonit", "podman-init", "tini", "docker-init", "dumb-init"})  # `run --init`'s PID 1


def process_of(argv: Sequence[str]) -> Process:
    """The process a command line runs, as the image's commands start them (a console script is run by its
    interpreter: ``python /opt/venv/bin/gpu-worker --gpu 1``; a module: ``python -m gpu_worker``), also behind an
    init process (``podman run --init``: ``/run/podman-init -- gunicorn ...``)."""
    if argv and os.path.basename(argv[0]) in INITS:
        rest = list(argv[1:])
        while rest and rest[0].startswith("-"):
            if rest.pop(0) == "--":
                break
        argv = rest
    words = [os.path.basename(a) for a in argv[:3]]
    if "-m" in words:
        module = argv[words.index("-m") + 1] if words.index("-m") + 1 < len(argv) else ""
        words = [{"gpu_worker": "gpu-worker", "tasks.broker.consumer": "llmb-batcher",
                  "webapp.jobs": "llmb-jobs"}.get(module, module)]
    if "gpu-worker" in words:
        gpu = _option(argv, "--gpu")
        return Process("worker", int(gpu) if gpu and gpu.isdigit() else 0, _option(argv, "--host"))
    if "gunicorn" in words:
        return Process("web")
    if "llmb-batcher" in words:
        return Process("batcher")
    if "llmb-jobs" in words:
        return Process("jobs")
    if "celery" in words and "flower" in argv:
        return Process("flower")
    return Process("other")


def local_url(bind: str) -> str:
    """The URL this host reaches a server bound to ``bind`` (``host:port``) at: a wildcard address is asked on
    loopback."""
    host, _, port = bind.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"
