"""`llmb-admin health`: the checks that container health checks and Kubernetes probes run.

Each prints one line saying why and exits 0 when healthy, 1 when not:

- ``health worker --gpu N [--live]``: that GPU worker's heartbeat in Redis is fresh and it is not stopping (with
  ``--live``, the liveness probe's form, a stopping worker still heartbeating is healthy);
- ``health api [--url URL]``: the API answers ``/readyz`` (Redis and the broker reachable, a worker alive);
- ``health links``: Redis and the broker answer (what the batcher and the jobs runner need);
- ``health self``: whichever of those fits the process this container runs (PID 1's command line), the check of the
  image's HEALTHCHECK.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import NoReturn

import click
import redis

from tasks.cli.main import Admin, cli, first_line, pass_admin, shown_url
from tasks.policy.health import HealthVerdict, local_url, process_of, worker_id, worker_verdict

API_TIMEOUT_S = 4.0  # under the image's HEALTHCHECK timeout (5 s)


@cli.group()
def health() -> None:
    """Health checks for probes: exit 0 when healthy, 1 when not, with one line saying why."""


def _report(verdict: HealthVerdict) -> NoReturn:
    click.echo(verdict.why)
    raise SystemExit(0 if verdict.healthy else 1)


@health.command("worker")
@click.option("--gpu", "device", required=True, type=click.IntRange(min=0), help="The worker's --gpu.")
@click.option("--host", default=socket.gethostname(), show_default=True, help="The worker's --host.")
@click.option("--live", is_flag=True,
              help="Liveness: a stopping (draining) worker whose heartbeat is fresh counts as healthy.")
@pass_admin
def worker_command(admin: Admin, device: int, host: str, live: bool) -> None:
    """A GPU worker: its heartbeat is fresh and (unless --live) it is not stopping."""
    _report(_worker(admin, device, host, draining_ok=live))


@health.command("api")
@click.option("--url", default=None, help="The API's base URL [default: LLMB_WEB_BIND's address, on loopback].")
@pass_admin
def api_command(admin: Admin, url: str | None) -> None:
    """The API: /readyz answers 200."""
    _report(_api(url or local_url(admin.settings.web.bind)))


@health.command("links")
@pass_admin
def links_command(admin: Admin) -> None:
    """Redis and the broker answer."""
    _report(_links(admin))


@health.command("self")
@pass_admin
def self_command(admin: Admin) -> None:
    """The check that fits this container's process (PID 1): web, a GPU worker, the batcher, jobs or Flower."""
    try:
        argv = [a for a in Path("/proc/1/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError as exc:
        _report(HealthVerdict(False, f"cannot read PID 1's command line: {exc}"))
    process = process_of(argv)
    if process.kind == "web":
        _report(_api(local_url(admin.settings.web.bind)))
    if process.kind == "worker":
        _report(_worker(admin, process.device, process.host or socket.gethostname()))
    if process.kind in ("batcher", "jobs", "flower"):
        _report(_links(admin))
    _report(HealthVerdict(True, f"no check for {' '.join(argv[:3]) or 'PID 1'}: running"))


def _worker(admin: Admin, device: int, host: str, *, draining_ok: bool = False) -> HealthVerdict:
    wanted = worker_id(device, host)
    redis_url = admin.settings.stores.redis_url
    try:
        fleet = admin.fleet()
        found = next((w for w in fleet.all() if w.id == wanted), None)  # the fleet's own reader, one HGETALL
        now = admin.clock()()
    except redis.RedisError as exc:
        return HealthVerdict(False, f"cannot reach Redis at {shown_url(redis_url)}: {first_line(exc, redis_url)}")
    return worker_verdict(wanted, found, now, fleet.stale_after_s, draining_ok=draining_ok)


def _api(url: str) -> HealthVerdict:
    target = url.rstrip("/") + "/readyz"
    try:
        with urllib.request.urlopen(target, timeout=API_TIMEOUT_S) as answer:
            return HealthVerdict(True, f"{target}: {answer.status} {answer.read(200).decode(errors='replace').strip()}")
    except urllib.error.HTTPError as exc:
        return HealthVerdict(False, f"{target}: {exc.code} {_message(exc.read(500))}")
    except (urllib.error.URLError, OSError) as exc:
        return HealthVerdict(False, f"{target}: {getattr(exc, 'reason', exc)}")


def _message(body: bytes) -> str:
    """The error message of an API answer's JSON body, or its first line."""
    try:
        error = json.loads(body).get("error", {})
        return str(error.get("message") or error) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return (body.decode(errors="replace").splitlines() or [""])[0]


def _links(admin: Admin) -> HealthVerdict:
    s = admin.settings
    try:
        admin.redis.ping()
    except redis.RedisError as exc:
        return HealthVerdict(False, f"cannot reach Redis at {shown_url(s.stores.redis_url)}: "
                              f"{first_line(exc, s.stores.redis_url)}")
    try:
        admin.publisher().ping()
    except Exception as exc:  # kombu's and amqp's errors alike
        return HealthVerdict(False, f"cannot reach the broker at {shown_url(s.broker.url)}: "
                                    f"{first_line(exc, s.broker.url)}")
    return HealthVerdict(True, "Redis and the broker answer")
