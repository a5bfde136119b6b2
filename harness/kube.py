"""The Kubernetes manifests (deploy/kubernetes/) as tests read them: rendered with `kubectl kustomize`, as an operator
would, and the arithmetic KEDA applies to their triggers.

Shared by tests/test_manifests.py (schemas and consistency), tests/test_kube_play.py (the local overlay under
`podman kube play`) and tests/test_autoscaling.py (the thresholds the ScaledObjects scale on).
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = {"base": KUBE / "base", "gpu": KUBE / "overlays" / "gpu", "local": KUBE / "overlays" / "local"}
EXAMPLES = KUBE / "examples"
SCHEMAS = KUBE / "schemas"

Obj = dict[str, Any]


def kubectl() -> str:
    """The kubectl binary (it carries kustomize); a clear failure where it is missing."""
    found = shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl is needed to render deploy/kubernetes (`kubectl kustomize`): install it "
                           "(https://kubernetes.io/docs/tasks/tools/); it ships kustomize, no cluster is needed")
    return found


def render(directory: Path) -> list[Obj]:
    """The objects `kubectl kustomize DIRECTORY` renders, in its order."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def load(path: Path) -> list[Obj]:
    """The objects of one YAML file (an example kept out of the overlays)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} {kind} named {name!r} in the rendered manifests")
    return found[0]


def pod_templates(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(owner, pod spec) of every workload: Deployments and Jobs."""
    for o in objects:
        if o["kind"] in ("Deployment", "Job"):
            yield o, o["spec"]["template"]["spec"]


def containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(owner, container) of every container and init container of every workload."""
    for owner, spec in pod_templates(objects):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield owner, c


def environment(objects: list[Obj], container: Obj) -> dict[str, str]:
    """The variables ``container`` starts with: its envFrom ConfigMaps and Secrets (decoded), then its env."""
    import base64

    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named(objects, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
        if "secretRef" in source:
            secret = named(objects, "Secret", source["secretRef"]["name"])
            env.update({k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()})
            env.update(secret.get("stringData", {}))
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


# -- KEDA ------------------------------------------------------------------------------------------------------
QUERY = re.compile(r'(?P<metric>[a-z_:][a-z0-9_:]*)\{model="(?P<model>[^"]+)"\}')


def trigger(scaled_object: Obj, metric: str) -> Obj:
    """The Prometheus trigger of ``scaled_object`` whose query reads ``metric``."""
    for t in scaled_object["spec"]["triggers"]:
        m = QUERY.search(t["metadata"].get("query", "")) if t["type"] == "prometheus" else None
        if m and m["metric"] == metric:
            return dict(t)
    raise LookupError(f"{scaled_object['metadata']['name']} has no prometheus trigger on {metric}")


def keda_replicas(scaled_object: Obj, values: dict[str, float]) -> int:
    """Replicas KEDA's HPA asks for, given each trigger's query result (by metric name): with KEDA's default
    metricType, AverageValue, each trigger wants ceil(value / threshold); the HPA takes the largest, within
    min and max replica counts (KEDA's Prometheus scaler docs; keda pkg/scalers GetMetricTargetType)."""
    spec = scaled_object["spec"]
    wanted = []
    for t in spec["triggers"]:
        if t.get("metricType", "AverageValue") != "AverageValue":
            raise ValueError(f"trigger {t.get('name')}: only AverageValue is modelled here")
        m = QUERY.search(t["metadata"]["query"])
        if m and m["metric"] in values:
            wanted.append(math.ceil(values[m["metric"]] / float(t["metadata"]["threshold"])))
    lo, hi = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
    return max(lo, min(hi, max(wanted, default=lo)))
