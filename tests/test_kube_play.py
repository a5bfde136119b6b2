"""The Kubernetes manifests, run: `podman kube play` the local overlay's API, batcher (active + standby), worker and
jobs Deployments from the image, against the host's RabbitMQ, Redis and PostgreSQL, and make real calls through them.

What runs is what deploy/kubernetes says: the containers' commands, their settings (the ConfigMap and the Secret),
the probes. The test wraps the local overlay in a kustomization of its own (tmp) that only isolates it: a name
suffix, its own namespace, vhost, database and ports. podman 4.3 runs a livenessProbe as the container's health check
(its exec command as written) and ignores readiness and startup probes, so the test runs those itself, as a kubelet
would: their exec commands inside the container, their HTTP GETs on the port they name.

Needs podman (with runc), kubectl and the image (`bin/image` builds it; the test builds it when it is missing).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from harness.kube import OVERLAYS, ROOT, Obj, environment, named, of_kind, render
from harness.services import Vhost, rabbitmqctl
from harness.stack import REDIS_URL, free_port, wait_for
from tasks.state.connect import redis_client
from tests.conftest import postgres_database

pytestmark = pytest.mark.timeout(900)

IMAGE = "localhost/llm-batcher:latest"
PLAYED = ("llmb-api", "llmb-batcher", "llmb-worker-lm", "llmb-worker-embed", "llmb-jobs")
# podman's defaults fail on these hosts (crun, and rlimits above the VM's hard limits): runc and lower ulimits
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1000:1000"]
[engine]
runtime = "runc"
"""


class Podman:
    """podman with this test's containers.conf."""

    def __init__(self, conf: Path) -> None:
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done


def image(podman: Podman) -> None:
    if podman("image", "exists", IMAGE, check=False).returncode == 0:
        return
    build = ROOT / "bin" / "image"
    assert build.exists(), f"{IMAGE} is missing and there is no bin/image to build it"
    done = subprocess.run([str(build)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"bin/image failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.fixture
def database() -> Iterator[str]:
    """A PostgreSQL database of this test's own, as the Secret's LLMB_DATABASE_URL."""
    with postgres_database("llmb_kube") as url:
        yield url


def isolated(tmp: Path, suffix: str, settings: dict[str, str], secrets: dict[str, str]) -> list[Obj]:
    """The local overlay, rendered through a kustomization that only renames and re-points it."""
    kustomization = {
        "resources": [os.path.relpath(OVERLAYS["local"], tmp)],
        "nameSuffix": f"-{suffix}",
        "configMapGenerator": [{"name": "llmb-settings", "behavior": "merge",
                                "literals": [f"{k}={v}" for k, v in settings.items()]}],
        "secretGenerator": [{"name": "llmb-secrets", "behavior": "merge",
                             "literals": [f"{k}={v}" for k, v in secrets.items()]}],
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(tmp)


def played_containers(objs: list[Obj], name: str) -> list[str]:
    """The podman containers `kube play` made of Deployment ``name``: one pod per replica, <name>-pod-<i>."""
    deployment = named(objs, "Deployment", name)
    ctr = deployment["spec"]["template"]["spec"]["containers"][0]["name"]
    return [f"{name}-pod-{i}-{ctr}" for i in range(deployment["spec"].get("replicas", 1))]


def spec_of(objs: list[Obj], name: str) -> Obj:
    return dict(named(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0])


def test_local_overlay_under_kube_play(tmp_path: Path, database: str) -> None:
    for tool in ("podman", "kubectl"):
        assert shutil.which(tool), f"{tool} is needed (bin/test installs podman; kubectl ships kustomize)"
    conf = tmp_path / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    podman = Podman(conf)
    image(podman)
    assert Vhost.available(), "rabbitmqctl is needed to give the test a vhost of its own"

    suffix = uuid.uuid4().hex[:8]
    namespace = f"k{suffix}"
    vhost = Vhost().create()
    ports = {"http": free_port(), "metrics": free_port()}
    settings = {"LLMB_NAMESPACE": namespace, "LLMB_WEB_BIND": f"127.0.0.1:{ports['http']}",
                "LLMB_METRICS_BIND": f"127.0.0.1:{ports['metrics']}"}
    secrets = {"LLMB_BROKER_URL": vhost.url, "LLMB_REDIS_URL": REDIS_URL, "LLMB_DATABASE_URL": database}
    render_dir = tmp_path / "kustomize"
    render_dir.mkdir()
    objs = isolated(render_dir, suffix, settings, secrets)
    names = {n: f"{n}-{suffix}" for n in PLAYED}
    secret = of_kind(objs, "Secret")[0]
    played = [o for o in objs if o["kind"] in ("ConfigMap", "PersistentVolumeClaim")
              or (o["kind"] == "Deployment" and o["metadata"]["name"] in names.values())]
    play = tmp_path / "play.yaml"
    play.write_text(yaml.safe_dump_all(played))
    secret_file = tmp_path / "secret.json"  # podman 4.3: a secretRef reads a podman secret holding {key: base64}
    secret_file.write_text(json.dumps(secret["data"]))
    api_spec = spec_of(objs, names["llmb-api"])
    env = environment(objs, api_spec)
    env_file = tmp_path / "env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    try:
        podman("secret", "create", secret["metadata"]["name"], str(secret_file))
        # the migration Job's command, as a one-shot container with the same settings
        job = named(render(OVERLAYS["base"]), "Job", "llmb-migrate")["spec"]["template"]["spec"]["containers"][0]
        podman("run", "--rm", "--network", "host", "--env-file", str(env_file), IMAGE, *job["command"])
        podman("kube", "play", str(play), timeout=600)
        check_running(podman, objs, names, env_file, ports, vhost.name)
    finally:
        logs = {c: (lambda done: done.stdout[-4000:] + done.stderr[-4000:])(
            podman("logs", c, check=False)) for d in names.values() for c in played_containers(objs, d)}
        down = podman("kube", "down", str(play), check=False, timeout=300)
        podman("secret", "rm", secret["metadata"]["name"], check=False)
        for claim in of_kind(played, "PersistentVolumeClaim"):
            podman("volume", "rm", "-f", claim["metadata"]["name"], check=False)
        vhost.delete()
        r = redis_client(REDIS_URL)
        for key in r.scan_iter(f"{namespace}:*", count=1000):
            r.delete(key)
        (tmp_path / "logs.json").write_text(json.dumps(logs, indent=1))
    assert down.returncode == 0, f"podman kube down failed: {down.stderr}"


def check_running(podman: Podman, objs: list[Obj], names: dict[str, str], env_file: Path, ports: dict[str, int],
                  vhost: str) -> None:
    url = f"http://127.0.0.1:{ports['http']}"
    api = spec_of(objs, names["llmb-api"])
    session = requests.Session()  # pooled, and no retries: every error counts

    def probe_get(probe: str) -> int:
        """The API's httpGet probe, as a kubelet sends it: its path, on gunicorn's port (the port the base's probe
        names: tests/test_manifests.py checks they agree; the local overlay declares no ports)."""
        get = api[probe]["httpGet"]
        return session.get(url + get["path"], timeout=api[probe].get("timeoutSeconds", 1)).status_code

    # ready: the API's readinessProbe answers 200 once Redis, the broker and a worker are there; both models served
    def both_models() -> bool:
        r = session.get(url + "/readyz", timeout=5)
        return r.status_code == 200 and {"sim-lm", "all-MiniLM-L6-v2"} <= set(r.json().get("models", []))

    try:
        wait_for(both_models, 240, "the API ready with both models' workers")
    except TimeoutError:
        states = podman("ps", "-a", "--format", "{{.Names}} {{.Status}}", check=False).stdout
        raise AssertionError(f"not ready; containers:\n{states}") from None
    assert probe_get("readinessProbe") == 200 and probe_get("livenessProbe") == 200

    # both batchers up on the single-active-consumer request queue: one active, the other its standby
    namespace = environment(objs, api)["LLMB_NAMESPACE"]

    def batchers() -> list[bool]:
        out = rabbitmqctl("list_consumers", "-p", vhost, "--formatter", "json", "queue_name", "active").stdout
        return [bool(c["active"]) for c in json.loads(out or "[]") if c["queue_name"] == f"{namespace}.requests"]

    wait_for(lambda: sorted(batchers()) == [False, True], 120, "two batchers on the request queue, one active")

    # an API key, made by the image's own admin CLI against the same database
    key = podman("run", "--rm", "--network", "host", "--env-file", str(env_file), IMAGE,
                 "llmb-admin", "keys", "create", "kube-test").stdout.strip().splitlines()[0]
    headers = {"Authorization": f"Bearer {key}"}

    for i in range(5):
        r = session.post(url + "/v1/chat/completions", headers=headers, timeout=30, json={
            "model": "sim-lm", "max_tokens": 8, "messages": [{"role": "user", "content": f"hello {i}"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    streamed: dict[str, Any] = {"model": "sim-lm", "max_tokens": 8, "stream": True,
                                "messages": [{"role": "user", "content": "a stream"}]}
    with session.post(url + "/v1/chat/completions", headers=headers, timeout=30, stream=True, json=streamed) as r:
        assert r.status_code == 200, r.text
        events = [line.decode() for line in r.iter_lines() if line.startswith(b"data: ")]
    assert len(events) >= 2 and events[-1] == "data: [DONE]", events
    r = session.post(url + "/v1/embeddings", headers=headers, timeout=30,
                     json={"model": "all-MiniLM-L6-v2", "input": ["a kube play", "of the manifests"]})
    assert r.status_code == 200, r.text
    vectors = [d["embedding"] for d in r.json()["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == 384
    metrics = session.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10)
    assert metrics.status_code == 200 and 'llmb_oldest_queued_seconds{model="sim-lm"}' in metrics.text

    # probes: the workers' as podman runs them (the livenessProbe is the container's health check), every exec probe
    # as a kubelet runs it, inside its container; every process runs as the image's user, not root
    for ctr, spec in [(c, spec_of(objs, d)) for d in names.values() for c in played_containers(objs, d)]:
        assert podman("exec", ctr, "id", "-u").stdout.strip() == "10001", f"{ctr} runs as root"
        inspect = json.loads(podman("inspect", ctr).stdout)[0]
        assert inspect["State"]["Status"] == "running", f"{ctr}: {inspect['State']}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in spec.get(probe, {}):
                done = podman("exec", ctr, *spec[probe]["exec"]["command"], check=False)
                assert done.returncode == 0, f"{ctr} {probe}: {done.stdout} {done.stderr}"
        if "exec" in spec.get("livenessProbe", {}):
            done = podman("healthcheck", "run", ctr, check=False)
            assert done.returncode == 0, f"{ctr}: podman's health check (its livenessProbe) failed: {done.stdout}"
            state = json.loads(podman("inspect", ctr).stdout)[0]["State"]
            assert state["Health"]["Status"] == "healthy", state["Health"]
            # and it can fail: the heartbeat of a device this pod does not run is not there
            other = podman("exec", ctr, "llmb-admin", "health", "worker", "--gpu", "7", check=False)
            assert other.returncode == 1, f"{ctr}: a probe of another device passed: {other.stdout}"

    # drains, within the grace the manifests give (podman 4.3 does not carry terminationGracePeriodSeconds over:
    # `podman stop -t` does it here). A batcher stops and the other one is (or stays) the active consumer, still
    # serving; a worker stops with exit code 0, its batches handed back.
    for deployment, ctr in ((names["llmb-batcher"], played_containers(objs, names["llmb-batcher"])[0]),
                            (names["llmb-worker-lm"], played_containers(objs, names["llmb-worker-lm"])[0])):
        grace = named(objs, "Deployment", deployment)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        podman("stop", "-t", str(grace), ctr, timeout=grace + 60)
        state = json.loads(podman("inspect", ctr).stdout)[0]["State"]
        assert state["ExitCode"] == 0, f"{ctr} did not drain cleanly on SIGTERM: {state}"
    wait_for(lambda: batchers() == [True], 30, "the remaining batcher active on the request queue")
    r = session.post(url + "/v1/embeddings", headers=headers, timeout=30,
                     json={"model": "all-MiniLM-L6-v2", "input": "served by the other batcher"})
    assert r.status_code == 200, r.text
