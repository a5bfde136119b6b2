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
from pathlib import Path

import redis
import requests
from kombu import Connection

ROOT = Path(__file__).resolve().parent.parent
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
        self.env = {**os.environ, "LLMB_NAMESPACE": self.namespace, "LLMB_BROKER_URL": BROKER_URL,
                    "LLMB_REDIS_URL": REDIS_URL, "LLMB_DATABASE_URL": self.database_url, "PYTHONUNBUFFERED": "1",
                    "LLMB_AUTH": "none"}  # tests of keys ask for LLMB_AUTH=keys
        self.env.update({f"LLMB_{k.upper()}": str(v) for k, v in env.items()})
        self.admin("db", "upgrade")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.redis = redis.Redis.from_url(self.env["LLMB_REDIS_URL"])
        self.port = 0

    # -- processes -----------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], raw_env: dict[str, str] | None = None,
               **env: object) -> subprocess.Popen[bytes]:
        extra = {f"LLMB_{k.upper()}": str(v) for k, v in env.items()} | (raw_env or {})
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def admin(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `llmb-admin` against this stack, as an operator would."""
        done = subprocess.run([str(BIN / "llmb-admin"), *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"llmb-admin {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout}\n{done.stderr}")
        return done

    def fleet(self) -> dict[str, dict[str, object]]:
        """Heartbeats by worker id, as the workers wrote them."""
        return {k.decode(): json.loads(v) for k, v in self.redis.hgetall(f"{self.namespace}:fleet").items()}

    def start_worker(self, device: int, backend: str = "sim", model: str | None = None,
                     **env: object) -> subprocess.Popen[bytes]:
        argv = [str(BIN / "gpu-worker"), "--gpu", str(device), "--host", "test", "--backend", backend]
        return self._spawn(f"gpu{device}", argv + (["--model", model] if model else []), **env)

    def start_batcher(self, name: str = "batcher", **env: object) -> subprocess.Popen[bytes]:
        return self._spawn(name, [str(BIN / "llmb-batcher"), "--hostname", f"{name}.{self.namespace}@test"], **env)

    def start_flower(self) -> str:
        """Flower as the Procfile runs it; its API open without auth, which the Procfile allows on localhost."""
        port = free_port()
        self._spawn("flower", [str(BIN / "celery"), "-A", "tasks.celery_app", "flower", "--address=127.0.0.1",
                               f"--port={port}"], raw_env={"FLOWER_UNAUTHENTICATED_API": "true"})
        return f"http://127.0.0.1:{port}"

    def start_web(self, name: str = "web", workers: int = 2, **env: object) -> str:
        port = free_port()
        self._spawn(name, [str(BIN / "gunicorn"), "-c", "webapp/gunicorn_conf.py", "webapp:create_app()"],
                    web_bind=f"127.0.0.1:{port}", web_workers=workers, **env)
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

    def live_workers(self) -> int:
        body = requests.get(self.url + "/readyz", timeout=5)
        return int(body.json().get("workers", 0)) if body.status_code == 200 else 0

    def wait_ready(self, workers: int) -> None:
        wait_for(lambda: self.live_workers() >= workers, 30, f"{workers} live worker(s)")

    def request_queue_depth(self) -> int:
        with Connection(BROKER_URL) as conn:
            _, count, _ = conn.default_channel.queue_declare(f"{self.namespace}.requests", passive=True)
            return int(count)

    def items_done(self) -> int:
        return int(self.redis.get(f"{self.namespace}:stats:items_done") or 0)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    # -- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        for name in list(self.procs):
            try:
                self.kill(name, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            for key in self.redis.scan_iter(f"{self.namespace}:*", count=1000):
                self.redis.delete(key)
        except redis.RedisError:
            pass  # a test's own Redis may be gone already
        with Connection(BROKER_URL) as conn:
            channel = conn.default_channel
            for queue in [f"{self.namespace}.requests", f"{self.namespace}.batcher", f"{self.namespace}.recovery",
                          *(f"{self.namespace}.gpu.test.{n}" for n in range(4))]:
                try:
                    channel.queue_delete(queue)
                except Exception:
                    channel = conn.channel()


def _get(url: str) -> int:
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return 0


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
