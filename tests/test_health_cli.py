"""`llmb-admin health`: the checks the image's HEALTHCHECK and the Kubernetes probes run. A worker's check reads its
heartbeat with the fleet's own reader; the API's asks /readyz; each exits 0 or 1 with one line saying why."""
from __future__ import annotations

import http.server
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result

from harness.stack import REDIS_URL, free_port
from tasks.cli import cli
from tasks.policy.health import Process, local_url, process_of, worker_id, worker_verdict
from tasks.schema import DRAINING, STARTING, WorkerInfo
from tasks.state.connect import redis_client
from tasks.state.fleet import Fleet


def heartbeat(device: int, host: str, *, age_s: float = 0.0, state: str = "idle") -> WorkerInfo:
    return WorkerInfo(id=worker_id(device, host), queue=f"q.{device}", model="sim", max_batch=8, state=state,
                      outstanding=0, completed=0, batch_started_at=None, batch_ms_estimate=10.0,
                      heartbeat_at=time.time() - age_s)


def test_a_worker_is_healthy_while_its_heartbeat_is_fresh_and_it_is_not_stopping() -> None:
    now = time.time()
    assert worker_verdict("gpu0@h", heartbeat(0, "h"), now, 6.0).healthy
    stale = worker_verdict("gpu0@h", heartbeat(0, "h", age_s=7.0), now, 6.0)
    assert not stale.healthy and "stale after 6 s" in stale.why
    draining = worker_verdict("gpu0@h", heartbeat(0, "h", state=DRAINING), now, 6.0)
    assert not draining.healthy and "draining" in draining.why
    assert worker_verdict("gpu0@h", heartbeat(0, "h", state=DRAINING), now, 6.0, draining_ok=True).healthy
    assert not worker_verdict("gpu0@h", heartbeat(0, "h", age_s=7.0), now, 6.0, draining_ok=True).healthy
    missing = worker_verdict("gpu0@h", None, now, 6.0)
    assert not missing.healthy and "no heartbeat" in missing.why
    starting = worker_verdict("gpu0@h", heartbeat(0, "h", state=STARTING), now, 6.0)
    assert not starting.healthy and "not consuming yet" in starting.why, "not ready before its consumer consumes"
    assert worker_verdict("gpu0@h", heartbeat(0, "h", state=STARTING), now, 6.0, draining_ok=True).healthy


def test_the_process_is_read_from_the_command_line_as_the_image_starts_it() -> None:
    venv = "/opt/venv/bin"
    assert process_of(["/opt/venv/bin/python3", f"{venv}/gunicorn", "-c", "webapp/gunicorn_conf.py",
                       "webapp:create_app()"]) == Process("web")
    assert process_of(["python3", f"{venv}/gpu-worker", "--gpu", "2", "--backend", "sim-lm"]) == Process("worker", 2)
    assert process_of(["python3", f"{venv}/gpu-worker", "--gpu=1", "--host", "node-a"]) == Process("worker", 1,
                                                                                                    "node-a")
    assert process_of(["python3", f"{venv}/gpu-worker"]) == Process("worker", 0)
    assert process_of(["python3", "-m", "gpu_worker", "--gpu", "3", "--no-supervise"]) == Process("worker", 3)
    assert process_of(["python3", f"{venv}/llmb-batcher"]).kind == "batcher"
    assert process_of(["python3", f"{venv}/llmb-jobs"]).kind == "jobs"
    assert process_of(["python3", f"{venv}/celery", "-A", "tasks.broker.celery_app", "flower"]).kind == "flower"
    assert process_of(["python3", f"{venv}/llmb-admin", "db", "upgrade"]).kind == "other"
    assert process_of([]).kind == "other"
    assert process_of(["/run/podman-init", "--", "python3", f"{venv}/gpu-worker", "--gpu", "1"]) == Process("worker", 1)
    assert process_of(["tini", "-g", "--", "python3", f"{venv}/llmb-batcher"]).kind == "batcher"


def test_a_wildcard_bind_is_asked_on_loopback() -> None:
    assert local_url("0.0.0.0:8000") == "http://127.0.0.1:8000"
    assert local_url("[::]:8000") == "http://[::1]:8000"
    assert local_url("10.0.0.5:9000") == "http://10.0.0.5:9000"


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"hc{uuid.uuid4().hex[:10]}"
    yield name
    client = redis_client(REDIS_URL)
    client.delete(f"{name}:fleet")
    client.close()


def health(namespace: str, *args: str, redis_url: str = REDIS_URL, broker_url: str | None = None) -> Result:
    options = ["--namespace", namespace, "--redis-url", redis_url]
    if broker_url:
        options += ["--broker-url", broker_url]
    return CliRunner().invoke(cli, [*options, "health", *args])


def test_the_worker_check_reads_the_fleet_hash(namespace: str) -> None:
    fleet = Fleet(redis_client(REDIS_URL), f"{namespace}:fleet", 6.0)
    assert health(namespace, "worker", "--gpu", "3", "--host", "node-a").exit_code == 1  # none yet
    fleet.beat(heartbeat(3, "node-a"))
    fresh = health(namespace, "worker", "--gpu", "3", "--host", "node-a")
    assert fresh.exit_code == 0 and "gpu3@node-a: idle, serving sim" in fresh.output, fresh.output
    other = health(namespace, "worker", "--gpu", "4", "--host", "node-a")
    assert other.exit_code == 1 and "gpu4@node-a: no heartbeat" in other.output, other.output
    fleet.beat(heartbeat(3, "node-a", age_s=600))
    stale = health(namespace, "worker", "--gpu", "3", "--host", "node-a")
    assert stale.exit_code == 1 and "last heartbeat" in stale.output, stale.output
    fleet.beat(heartbeat(3, "node-a", state=DRAINING))
    assert health(namespace, "worker", "--gpu", "3", "--host", "node-a").exit_code == 1
    assert health(namespace, "worker", "--gpu", "3", "--host", "node-a", "--live").exit_code == 0


def test_the_worker_check_fails_with_a_line_when_redis_is_away(namespace: str) -> None:
    result = health(namespace, "worker", "--gpu", "0", redis_url=f"redis://127.0.0.1:{free_port()}/0")
    assert result.exit_code == 1 and result.output.startswith("cannot reach Redis"), result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.fixture
def api() -> Iterator[dict[str, int]]:
    """A stand-in for the API's /readyz, answering the status that the test sets."""
    answer = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "ready"}' if answer["status"] == 200 else b'{"error": {"message": "no worker"}}'
            self.send_response(answer["status"] if self.path == "/readyz" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    answer["port"] = server.server_address[1]
    yield answer
    server.shutdown()
    server.server_close()


def test_the_api_check_asks_readyz(namespace: str, api: dict[str, int]) -> None:
    url = f"http://127.0.0.1:{api['port']}"
    ready = health(namespace, "api", "--url", url)
    assert ready.exit_code == 0 and "/readyz: 200" in ready.output, ready.output
    api["status"] = 503
    unready = health(namespace, "api", "--url", url)
    assert unready.exit_code == 1 and "503 no worker" in unready.output, unready.output
    closed = health(namespace, "api", "--url", f"http://127.0.0.1:{free_port()}")
    assert closed.exit_code == 1 and "/readyz" in closed.output, closed.output


def test_the_links_check_needs_redis_and_the_broker(namespace: str) -> None:
    assert health(namespace, "links").exit_code == 0
    broker_away = health(namespace, "links", broker_url=f"amqp://guest:guest@127.0.0.1:{free_port()}//")
    assert broker_away.exit_code == 1 and "cannot reach the broker" in broker_away.output, broker_away.output
