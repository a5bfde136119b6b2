"""Run the system's processes as containers of its image (podman), for the image's end-to-end test.

Each container runs one process by its command, as a Procfile line does, on the host's network (so it reaches the
host's RabbitMQ, Redis and PostgreSQL on 127.0.0.1), with the settings of one stack passed as ``LLMB_*``
variables. Every container is labelled with the stack's namespace, and :meth:`Containers.close` removes them all.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/llm-batcher:latest"
# runc, host network, limits within the VM's hard ones (podman's defaults fail here: see FACTS.md)
PODMAN = ("podman", "--runtime", "runc")
RUN_FLAGS = ("--network", "host", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000")


def podman_missing() -> str | None:
    """Why the image cannot be built or run here, or None."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return (f"{tool} is not installed: the container image test needs podman and runc (and mmdebstrap for "
                    "the base image); bin/test installs them (Debian: apt-get install podman runc mmdebstrap)")
    return None


def podman(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def build_image(timeout_s: float = 1800) -> str:
    """bin/image's output (cached layers make it quick after the first build); raises if it failed."""
    done = subprocess.run([str(ROOT / "bin" / "image")], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"bin/image failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stderr.strip().splitlines()[-1]


class Containers:
    """The containers of one stack (its namespace), started from ``image`` with ``env`` as their settings."""

    def __init__(self, namespace: str, env: Mapping[str, str], image: str = IMAGE,
                 volumes: Sequence[str] = ()) -> None:
        self.namespace = namespace
        self.env = dict(env)
        self.image = image
        self.volumes = list(volumes)
        self.names: list[str] = []

    def _options(self, name: str, env: Mapping[str, str]) -> list[str]:
        options = [*RUN_FLAGS, "--hostname", name, "--label", f"llmb.test={self.namespace}"]
        for key, value in {**self.env, **env}.items():
            options += ["--env", f"{key}={value}"]
        for volume in self.volumes:
            options += ["--volume", volume]
        return options

    def run_once(self, role: str, *command: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``command`` in a container of its own to the end (a one-shot job, as a Kubernetes Job runs it)."""
        name = f"{self.namespace}-{role}"
        return podman("run", "--rm", "--name", name, *self._options(name, {}), self.image, *command,
                      timeout_s=timeout_s, check=False)

    def start(self, role: str, *command: str, env: Mapping[str, str] | None = None) -> str:
        """Start ``command`` (the image's default, the web API, when empty) in a detached container; its name."""
        name = f"{self.namespace}-{role}"
        podman("run", "--detach", "--name", name, *self._options(name, env or {}), self.image, *command)
        self.names.append(name)
        return name

    def inspect(self, name: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(podman("inspect", name).stdout)
        return found[0]

    def running(self, name: str) -> bool:
        return bool(self.inspect(name)["State"]["Running"])

    def healthcheck(self, name: str) -> subprocess.CompletedProcess[str]:
        """Run the image's HEALTHCHECK in ``name`` now (exit 0: healthy)."""
        return podman("healthcheck", "run", name, check=False, timeout_s=30)

    def exec(self, name: str, *command: str) -> subprocess.CompletedProcess[str]:
        return podman("exec", name, *command, check=False)

    def stop(self, name: str, grace_s: int = 60) -> int:
        """SIGTERM, as `podman stop` and Kubernetes send it, SIGKILL after ``grace_s``; the exit code."""
        podman("stop", "--time", str(grace_s), name, timeout_s=grace_s + 30)
        return int(self.inspect(name)["State"]["ExitCode"])

    def logs(self, name: str) -> str:
        done = podman("logs", name, check=False)
        return done.stdout + done.stderr

    def close(self) -> None:
        """Remove every container of this stack, running or not."""
        found = podman("ps", "--all", "--quiet", "--filter", f"label=llmb.test={self.namespace}", check=False)
        ids = found.stdout.split()
        if ids:
            podman("rm", "--force", "--time", "5", *ids, check=False, timeout_s=120)


def remove_namespace(redis_url: str, broker_url: str, namespace: str, queues: Sequence[str]) -> None:
    """Remove a stack's Redis keys and its ``queues`` (as :meth:`harness.stack.Stack.close` does for its own)."""
    import redis
    from kombu import Connection

    from tasks.state.connect import redis_client

    client = redis_client(redis_url)
    try:
        for key in client.scan_iter(f"{namespace}:*", count=1000):
            client.delete(key)
    except redis.RedisError:
        pass
    finally:
        client.close()
    with Connection(broker_url, connect_timeout=5) as conn:
        channel = conn.default_channel
        for queue in queues:
            try:
                channel.queue_delete(queue)
            except Exception:  # a queue never declared closes the channel: go on with a new one
                channel = conn.channel()
