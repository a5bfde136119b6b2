"""The container image, run as the system: every process in a container of ``localhost/llm-batcher:latest`` (built by
bin/image, cached after the first build) against the host's RabbitMQ, Redis and PostgreSQL, as a deployment runs it.

The migration runs as a one-shot container against a new PostgreSQL database; then the web API, the batcher, a
sim-lm worker, an all-MiniLM-L6-v2 (hf-embed) worker, the jobs runner and Flower, each started by its own command
with its settings in ``LLMB_*`` variables and the files folder a mounted volume. Calls go through real pooled
clients; the image's health check is run in every container; each process runs as uid 10001 and exits 0 on SIGTERM
(`podman stop`).

Marked ``image`` (``pytest -m image`` selects it); without podman it fails, saying how to install it.
"""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests

from harness.containers import Containers, build_image, podman_missing, remove_namespace
from harness.stack import BROKER_URL, REDIS_URL, free_port, wait_for
from tasks.config import Settings
from tests.conftest import postgres_database

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]  # a cold build takes minutes; a cached one seconds

LM, EMBED = "sim-lm", "all-MiniLM-L6-v2"
PROCESSES = {  # container role: command (empty: the image's default, the web API), as the Procfile's lines
    "web": (),
    "batcher": ("llmb-batcher",),
    "lm": ("gpu-worker", "--gpu", "0", "--backend", "sim-lm"),
    "embed": ("gpu-worker", "--gpu", "1", "--backend", "hf-embed"),
    "jobs": ("llmb-jobs",),
}
TIMEOUT_S = 30


@dataclass
class System:
    containers: Containers
    url: str
    names: dict[str, str]  # role: container name


@pytest.fixture(scope="module")
def image() -> str:
    missing = podman_missing()
    if missing:
        pytest.fail(missing)
    return build_image()


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A new PostgreSQL database, dropped afterwards."""
    with postgres_database("llmb_image") as url:
        yield url


def serving(url: str, http: requests.Session) -> bool:
    """/readyz answers and both models are served."""
    answer = http.get(url + "/readyz", timeout=2)
    return answer.status_code == 200 and {LM, EMBED} <= set(answer.json().get("models", []))


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:  # no retries: every error counts
        yield session


@pytest.fixture(scope="module")
def system(image: str, database: str, http: requests.Session,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    namespace = "t" + uuid.uuid4().hex[:10]
    port, flower_port = free_port(), free_port()
    shared = Path(tmp_path_factory.mktemp("image-data"))
    os.chmod(shared, 0o777)  # written by the containers' user (uid 10001)
    env = {"LLMB_NAMESPACE": namespace, "LLMB_BROKER_URL": BROKER_URL, "LLMB_REDIS_URL": REDIS_URL,
           "LLMB_DATABASE_URL": database, "LLMB_AUTH": "none", "LLMB_WEB_BIND": f"127.0.0.1:{port}",
           "LLMB_WEB_WORKERS": "1", "LLMB_FILES_DIR": "/data/files"}
    containers = Containers(namespace, env, volumes=[f"{shared}:/data"])
    settings = Settings.of(namespace=namespace)
    try:
        migrated = containers.run_once("migrate", "llmb-admin", "db", "upgrade")
        assert migrated.returncode == 0 and "is at head" in migrated.stdout, migrated.stdout + migrated.stderr
        names = {role: containers.start(role, *command) for role, command in PROCESSES.items()}
        names["flower"] = containers.start("flower", "celery", "-A", "tasks.broker.celery_app", "flower",
                                           "--address=127.0.0.1", f"--port={flower_port}")
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            for role, name in names.items():
                assert containers.running(name), f"{role} exited:\n{containers.logs(name)[-3000:]}"
            return serving(url, http) and http.get(f"http://127.0.0.1:{flower_port}/healthcheck",
                                                   timeout=2).status_code == 200

        wait_for(up, 240, "the API, the batcher and both workers in containers to serve")
        yield System(containers, url, names)
    finally:
        containers.close()
        remove_namespace(REDIS_URL, BROKER_URL, namespace,
                         [settings.request_queue, settings.recovery_queue, f"{namespace}.batcher",
                          *(settings.gpu_queue(f"{namespace}-{role}", n) for n, role in enumerate(("lm", "embed")))])


def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


def test_every_process_runs_as_llmb_not_root(system: System) -> None:
    for role, name in system.names.items():
        uid = system.containers.exec(name, "id", "-u")
        assert uid.stdout.strip() == "10001", f"{role}: {uid.stdout} {uid.stderr}"
        assert system.containers.inspect(name)["Config"]["User"] == "10001:10001"


def test_calls_are_answered_through_the_containers(system: System) -> None:
    c = client(system)
    chat = c.chat.completions.create(model=LM, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens > 0, chat
    stream = c.chat.completions.create(model=LM, messages=[{"role": "user", "content": "stream"}], max_tokens=5,
                                       stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces), pieces
    vectors = c.embeddings.create(model=EMBED, input=["a container", "an image"])
    assert [len(v.embedding) for v in vectors.data] == [384, 384]


def test_a_batch_job_runs_in_the_jobs_container(system: System) -> None:
    c = client(system)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": LM, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3}}
             for i in range(3)]
    upload = c.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")

    def ended() -> openai.types.Batch | None:
        found = c.batches.retrieve(batch.id)
        return found if found.status in ("completed", "failed", "cancelled", "expired") else None

    done = wait_for(ended, 120, f"batch {batch.id} to end")
    assert done.status == "completed" and done.output_file_id, done
    out = [json.loads(line) for line in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted((x["custom_id"], x["response"]["status_code"]) for x in out) == [("c0", 200), ("c1", 200),
                                                                                  ("c2", 200)]


def test_the_health_checks_report_healthy(system: System) -> None:
    for role, name in system.names.items():
        checked = system.containers.healthcheck(name)
        assert checked.returncode == 0, f"{role}: {checked.stdout} {checked.stderr}"
    worker = system.containers.exec(system.names["lm"], "llmb-admin", "health", "worker", "--gpu", "0")
    assert worker.returncode == 0 and "serving sim-lm" in worker.stdout, worker.stdout + worker.stderr
    absent = system.containers.exec(system.names["lm"], "llmb-admin", "health", "worker", "--gpu", "5")
    assert absent.returncode == 1 and "no heartbeat" in absent.stdout, absent.stdout + absent.stderr
    api = system.containers.exec(system.names["web"], "llmb-admin", "health", "api")
    assert api.returncode == 0 and "/readyz: 200" in api.stdout, api.stdout + api.stderr


def test_sigterm_drains_every_process_and_it_exits_0(system: System) -> None:
    """Last: stops the system. Workers first (their batches handed back), then jobs, the batcher, Flower and the
    API."""
    def stop(role: str) -> None:
        code = system.containers.stop(system.names[role])
        assert code == 0, f"{role} exited {code} on SIGTERM:\n{system.containers.logs(system.names[role])[-3000:]}"

    stop("embed")
    stop("lm")
    # the API's health check means it: with no worker left (each left the fleet as it stopped) it is unhealthy
    wait_for(lambda: system.containers.healthcheck(system.names["web"]).returncode == 1, 30,
             "the API's health check to fail once no worker is left")
    for role in ("jobs", "batcher", "flower", "web"):
        stop(role)
