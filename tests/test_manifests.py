"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every object is valid against the Kubernetes
schemas of a pinned version (kubernetes-validate, strict: an unknown field is an error, as `kubectl apply` makes it)
and the ScaledObjects against KEDA's own CRD, and the manifests agree with the code: the commands are the
project's entry points and parse, the settings exist, the probes reach open routes and real commands, the
autoscaling queries name series /metrics exports for the model the target serves, and selectors select.
"""
from __future__ import annotations

import copy
import math
import shlex
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml

from harness.kube import (
    EXAMPLES,
    OVERLAYS,
    QUERY,
    ROOT,
    SCHEMAS,
    Obj,
    containers,
    environment,
    load,
    named,
    of_kind,
    pod_templates,
    render,
    trigger,
)
from tasks.config import FLAT, Settings

KUBERNETES_VERSION = "1.32.0"  # the schemas checked against: kubernetes-validate ships one set per release
IMAGE = "localhost/llm-batcher:latest"
NOT_SETTINGS = {"FLOWER_BASIC_AUTH", "HF_HOME"}  # variables read by what the processes run on, not LLMB settings


@cache
def rendered(overlay: str) -> tuple[Obj, ...]:
    return tuple(render(OVERLAYS[overlay]))


def objects(overlay: str) -> list[Obj]:
    return copy.deepcopy(list(rendered(overlay)))


def label(o: Obj) -> str:
    return f"{o['kind']}/{o['metadata']['name']}"


# -- schemas ---------------------------------------------------------------------------------------------------
def _closed(schema: Any) -> Any:
    """A CRD's structural schema with unknown fields rejected, as the API server's strict field validation does
    (a structural schema prunes what it does not declare unless x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator of the vendored KEDA CRDs' openAPIV3Schema (deploy/kubernetes/schemas)."""
    out = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        for crd in load(path):
            for version in crd["spec"]["versions"]:
                schema = _closed(version["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by its own rules
                api = f"{crd['spec']['group']}/{version['name']}"
                out[(api, crd["spec"]["names"]["kind"])] = jsonschema.Draft7Validator(schema)
    return out


def schema_errors(o: Obj) -> list[str]:
    """Why ``o`` is invalid (none: it is valid): a KEDA object against its CRD, anything else against Kubernetes'."""
    key = (o["apiVersion"], o["kind"])
    if o["apiVersion"].startswith("keda.sh/"):
        if key not in crd_validators():
            return [f"{label(o)}: no vendored CRD for {key}"]
        return [f"{label(o)}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in crd_validators()[key].iter_errors(o)]
    try:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{label(o)}: {'/'.join(map(str, e.path))}: {e.message}"]
    return []


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_object_is_valid(overlay: str) -> None:
    objs = objects(overlay)
    assert objs, f"{overlay} renders nothing"
    errors = [e for o in objs for e in schema_errors(o)]
    assert not errors, f"{overlay}: {len(errors)} invalid:\n" + "\n".join(errors)


def test_examples_are_valid() -> None:
    """The documented alternatives (the RabbitMQ queue-length trigger) are as valid as what is deployed."""
    examples = [o for path in sorted(EXAMPLES.glob("*.yaml")) for o in load(path)]
    assert {o["kind"] for o in examples} >= {"ScaledObject", "TriggerAuthentication"}
    errors = [e for o in examples for e in schema_errors(o)]
    assert not errors, "\n".join(errors)


def test_the_crd_check_can_fail() -> None:
    """A misspelt field and a wrong type are caught: the CRD check is not vacuous."""
    scaled = copy.deepcopy(of_kind(objects("base"), "ScaledObject")[0])
    scaled["spec"]["pollingIntervall"] = 15
    scaled["spec"]["minReplicaCount"] = "one"
    text = "\n".join(schema_errors(scaled))
    assert "pollingIntervall" in text and "minReplicaCount" in text, text
    deployment = copy.deepcopy(of_kind(objects("base"), "Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    assert schema_errors(deployment), "an unknown container field must be an error"


def test_the_base_runs_everything() -> None:
    """Deployments for the API, the batcher (active + standby), each model's workers, jobs and Flower; the
    migration Job; the Services; settings and credentials; budgets; the autoscalers."""
    objs = objects("base")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for kind, name in [("Deployment", "llmb-api"), ("Deployment", "llmb-batcher"), ("Deployment", "llmb-worker-lm"),
                       ("Deployment", "llmb-worker-embed"), ("Deployment", "llmb-jobs"),
                       ("Deployment", "llmb-flower"), ("Job", "llmb-migrate"), ("Service", "llmb-api"),
                       ("Service", "llmb-metrics"), ("Service", "llmb-flower"),
                       ("HorizontalPodAutoscaler", "llmb-api"), ("ScaledObject", "llmb-worker-lm"),
                       ("ScaledObject", "llmb-worker-embed")]:
        assert (kind, name) in kinds, f"{kind}/{name} missing from the base"
    assert named(objs, "Deployment", "llmb-batcher")["spec"]["replicas"] == 2, "an active batcher and a standby"
    assert all(c["image"] == IMAGE for _, c in containers(objs))
    assert len(of_kind(objs, "ConfigMap")) == 1 and len(of_kind(objs, "Secret")) == 1


# -- commands ----------------------------------------------------------------------------------------------------
def scripts() -> dict[str, str]:
    """The console scripts pyproject.toml installs (what the image puts on PATH), to their click commands."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def click_command(target: str) -> click.Command:
    import importlib

    module, _, attr = target.partition(":")
    found = importlib.import_module(module)
    command = getattr(found, attr)
    if not isinstance(command, click.Command):  # a plain function around the module's group (llmb-admin's main)
        command = getattr(found, "cli", None)
    assert isinstance(command, click.Command), f"{target} is not a click command"
    return command


def parses(command: click.Command, name: str, args: list[str]) -> None:
    """Parse ``args`` as the command line of ``command`` (down its sub-commands) without running it: an unknown
    option, sub-command or choice raises click's UsageError."""
    ctx = command.make_context(name, list(args))
    while isinstance(command, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        assert rest, f"{name}: a group needs a sub-command"
        sub_name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None and sub_name is not None
        command, ctx = sub, sub.make_context(sub_name, rest, parent=ctx)


def check_command(argv: list[str]) -> None:
    """``argv`` runs a real entry point of the project with a command line it accepts."""
    program, args = argv[0], argv[1:]
    if program in scripts():
        parses(click_command(scripts()[program]), program, args)
    elif program == "gunicorn":  # the Procfile's: gunicorn -c webapp/gunicorn_conf.py 'webapp:create_app()'
        assert args[0] == "-c" and (ROOT / args[1]).is_file(), f"gunicorn's config {args[1:2]} is not in the tree"
        module, _, call = args[2].partition(":")
        assert module == "webapp" and call == "create_app()", args
        import webapp
        assert callable(webapp.create_app)
    elif program == "celery":
        assert args[:2] == ["-A", "tasks.broker.celery_app"] and args[2] == "flower", args
        import tasks.broker.celery_app  # noqa: F401
    else:
        raise AssertionError(f"{shlex.join(argv)}: {program} is not a command of the image")


def commands(objs: list[Obj]) -> Iterator[tuple[str, list[str]]]:
    """(where, argv) of every container command and exec probe."""
    for owner, c in containers(objs):
        yield f"{label(owner)} command", [*c.get("command", []), *c.get("args", [])]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in c.get(probe, {}):
                yield f"{label(owner)} {probe}", c[probe]["exec"]["command"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_commands_are_entry_points(overlay: str) -> None:
    failures = []
    for where, argv in commands(objects(overlay)):
        try:
            check_command(argv)
        except (AssertionError, click.UsageError) as e:
            failures.append(f"{where}: {shlex.join(argv)}: {e}")
    assert not failures, "\n".join(failures)


def test_a_wrong_command_is_caught() -> None:
    for argv in (["gpu-worker", "--gpu", "0", "--backend", "sim-llm"], ["llmb-admin", "db", "upgrad"],
                 ["llmb-batchr"]):
        with pytest.raises((AssertionError, click.UsageError)):
            check_command(argv)


# -- settings ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_variable_is_a_setting(overlay: str) -> None:
    """Every variable the ConfigMap, the Secret and the containers' env set is a real LLMB_* setting (a typo would
    be ignored silently by the process), or one of the few others named on purpose."""
    objs = objects(overlay)
    names = set()
    for o in of_kind(objs, "ConfigMap") + of_kind(objs, "Secret"):
        names |= set(o.get("data", {})) | set(o.get("stringData", {}))
    for _, c in containers(objs):
        names |= {e["name"] for e in c.get("env", [])}
    unknown = sorted(n for n in names if n not in NOT_SETTINGS
                     and not (n.startswith("LLMB_") and n[len("LLMB_"):].lower() in FLAT))
    assert not unknown, f"{overlay}: not settings (tasks/config.py): {unknown}"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_settings_parse(overlay: str) -> None:
    """Each process's environment makes valid settings (a bad value stops a process at its start)."""
    from tasks.config import Settings

    for owner, c in containers(objects(overlay)):
        env = {k: v for k, v in environment(objects(overlay), c).items() if k.startswith("LLMB_")}
        Settings.from_env(env)  # raises on a value it cannot read
        assert env, f"{label(owner)} has no settings"


# -- probes ------------------------------------------------------------------------------------------------------
def api_routes_open() -> set[str]:
    """Routes answered without an API key: the only ones a kubelet can probe."""
    from webapp.openapi_links import OPEN

    return set(OPEN)


def flower_routes() -> set[str]:
    from flower.urls import handlers

    return {(h[0] if isinstance(h, tuple) else h.regex.pattern).rstrip("$") for h in handlers}


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_probes_reach_real_routes(overlay: str) -> None:
    """httpGet probes name an open route of the process they probe, on a port the container declares; for the API,
    the port gunicorn binds (LLMB_WEB_BIND). (The local overlay's probes are the base's: see below.)"""
    objs = objects(overlay)
    seen = 0
    for owner, c in containers(objs):
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c.get(probe, {}).get("httpGet")
            if not get:
                continue
            seen += 1
            port = ports.get(get["port"], get["port"])
            assert port in ports.values(), f"{label(owner)} {probe}: port {get['port']} is not declared"
            if c["command"][0] == "gunicorn":
                assert get["path"] in api_routes_open(), f"{label(owner)} {probe}: {get['path']} needs a key"
                bind = environment(objs, c)["LLMB_WEB_BIND"]
                assert int(bind.rpartition(":")[2]) == port, f"{label(owner)}: probes {port}, gunicorn binds {bind}"
            else:
                assert c["command"][:4] == ["celery", "-A", "tasks.broker.celery_app", "flower"]
                assert get["path"] in flower_routes(), f"{label(owner)} {probe}: Flower has no {get['path']}"
                assert f"--port={port}" in c["command"]
    assert seen >= 4, "the API and Flower are probed over HTTP"
    api = named(objs, "Deployment", "llmb-api")["spec"]["template"]["spec"]["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_workers_probe_their_own_heartbeat(overlay: str) -> None:
    """Every worker's probes ask for its own heartbeat: `llmb-admin health worker --gpu N` with the N it runs; the
    liveness probe with --live, so that a draining worker is not killed while it hands its batches back."""
    for owner, c in containers(objects(overlay)):
        if c["command"][0] != "gpu-worker":
            continue
        check = ["llmb-admin", "health", "worker", "--gpu", c["command"][c["command"].index("--gpu") + 1]]
        for probe, argv in (("startupProbe", check), ("readinessProbe", check), ("livenessProbe", [*check, "--live"])):
            assert c[probe]["exec"]["command"] == argv, f"{label(owner)} {probe}"


# -- drains ------------------------------------------------------------------------------------------------------
def test_drain_times() -> None:
    """Grace periods cover each process's drain (docs/operations.md#kubernetes): the API's preStop sleep (so the
    endpoints drop it first) plus gunicorn's graceful stop, which may hold a call to its deadline (30 s by default);
    60 s plus a batch for a worker."""
    objs = objects("base")
    grace = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
             for o in of_kind(objs, "Deployment")}
    api = named(objs, "Deployment", "llmb-api")["spec"]["template"]["spec"]["containers"][0]
    sleep = int(api["lifecycle"]["preStop"]["exec"]["command"][1])
    # gunicorn's graceful_timeout is this setting (webapp/gunicorn_conf.py); that module is not imported here: it
    # sets PROMETHEUS_MULTIPROC_DIR in os.environ, which every stack a later test starts would then share
    graceful_s = math.ceil(Settings.from_env().web.graceful_s)
    assert sleep >= 5 and grace["llmb-api"] > sleep + max(30, graceful_s), grace
    assert grace["llmb-batcher"] >= 30 and grace["llmb-jobs"] >= 60
    assert grace["llmb-worker-lm"] > 60 and grace["llmb-worker-embed"] > 60
    gpu = named(objects("gpu"), "Deployment", "llmb-worker-lm")["spec"]["template"]["spec"]
    assert gpu["terminationGracePeriodSeconds"] >= grace["llmb-worker-lm"]


# -- autoscaling -------------------------------------------------------------------------------------------------
def exported_series() -> set[str]:
    """The per-model series /metrics exports (tasks/state/metrics.py), by name."""
    from tasks.state.metrics import _per_model

    row = {"model": "m", "oldest_queued_s": 0.0, "arrival_rate_per_s": 0.0, "workers": 1, "recommended_workers": 1}
    return {family.name for family in _per_model([row])}


def served_model(objs: list[Obj], deployment: Obj) -> str:
    """The model a worker Deployment serves, as the worker names it (gpu_worker.backends.registry.served_name)."""
    from gpu_worker.__main__ import main
    from gpu_worker.backends.registry import served_name

    c = deployment["spec"]["template"]["spec"]["containers"][0]
    ctx = main.make_context("gpu-worker", c["command"][1:])
    return served_name(ctx.params["backend"], ctx.params["model"], environment(objs, c).get("LLMB_SERVED_NAME", ""))


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_every_worker_pool_scales_on_its_own_queue_age(overlay: str) -> None:
    """One ScaledObject per worker Deployment; its queries read series /metrics exports, for the very model the
    Deployment's workers serve (a renamed model would otherwise scale on a series that never appears)."""
    objs = objects(overlay)
    workers = [o for o in of_kind(objs, "Deployment")
               if o["spec"]["template"]["spec"]["containers"][0]["command"][0] == "gpu-worker"]
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in of_kind(objs, "ScaledObject")}
    assert sorted(scaled) == sorted(w["metadata"]["name"] for w in workers)
    series = exported_series()
    for w in workers:
        so, model = scaled[w["metadata"]["name"]], served_model(objs, w)
        age = trigger(so, "llmb_oldest_queued_seconds")
        trigger(so, "llmb_recommended_workers")
        for t in so["spec"]["triggers"]:
            m = QUERY.search(t["metadata"]["query"])
            assert m and m["metric"] in series, f"{label(so)}: {t['metadata']['query']} reads no exported series"
            assert m["model"] == model, f"{label(so)} asks for model {m['model']!r}, the workers serve {model!r}"
            assert t["metadata"]["serverAddress"].startswith("http")
        assert float(age["metadata"]["threshold"]) > 0


def test_gpu_overlay_asks_for_gpus() -> None:
    objs = objects("gpu")
    spec = named(objs, "Deployment", "llmb-worker-lm")["spec"]["template"]["spec"]
    worker = spec["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1 == worker["resources"]["requests"]["nvidia.com/gpu"]
    assert worker["command"][worker["command"].index("--backend") + 1] == "hf-causal"
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    base = named(objects("base"), "Deployment", "llmb-worker-lm")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in str(base["resources"]), "the base runs on CPU"


# -- selectors and references ------------------------------------------------------------------------------------
def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_selectors_select(overlay: str) -> None:
    """A Deployment's selector matches its own pods and no other Deployment's; each Service and budget selects the
    pods of exactly one Deployment; autoscalers target Deployments that exist; envFrom and volumes name objects
    that exist."""
    objs = objects(overlay)
    pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in of_kind(objs, "Deployment")}
    for o in of_kind(objs, "Deployment"):
        sel = o["spec"]["selector"]["matchLabels"]
        assert [n for n, labels in pods.items() if selects(sel, labels)] == [o["metadata"]["name"]], label(o)
    for o in of_kind(objs, "Service"):
        assert len([n for n, labels in pods.items() if selects(o["spec"]["selector"], labels)]) == 1, label(o)
    for o in of_kind(objs, "PodDisruptionBudget"):
        assert len([n for n, labels in pods.items() if selects(o["spec"]["selector"]["matchLabels"], labels)]) == 1
    for o in of_kind(objs, "HorizontalPodAutoscaler") + of_kind(objs, "ScaledObject"):
        target = o["spec"]["scaleTargetRef"]["name"]
        assert target in pods, label(o)
        # an autoscaler owns the count: a replicas field would reset it on every `kubectl apply`
        assert "replicas" not in named(objs, "Deployment", target)["spec"], f"{target} sets replicas under {label(o)}"
    claims = {o["metadata"]["name"] for o in of_kind(objs, "PersistentVolumeClaim")}
    for owner, spec in pod_templates(objs):
        for v in spec.get("volumes", []):
            assert "persistentVolumeClaim" not in v or v["persistentVolumeClaim"]["claimName"] in claims, label(owner)
    for owner, c in containers(objs):
        environment(objs, c)  # every envFrom names a rendered ConfigMap or Secret (LookupError otherwise)
        ports = {p["name"] for p in c.get("ports", [])}
        for o in of_kind(objs, "Service"):
            if selects(o["spec"]["selector"], owner["spec"]["template"]["metadata"]["labels"]):
                assert {p["targetPort"] for p in o["spec"]["ports"]} <= ports, f"{label(o)} -> {label(owner)}"


def test_local_overlay_differs_little() -> None:
    """The local overlay runs the base's commands, probes and settings: only host networking, the pull policy,
    the replica count of the API, the declared ports, the service URLs and the two bind addresses differ."""
    base, local = objects("base"), objects("local")
    for o in of_kind(local, "Deployment"):
        b = named(base, "Deployment", o["metadata"]["name"])
        lc, bc = o["spec"]["template"]["spec"]["containers"][0], b["spec"]["template"]["spec"]["containers"][0]
        for key in ("command", "startupProbe", "readinessProbe", "livenessProbe", "env", "lifecycle", "image"):
            assert lc.get(key) == bc.get(key), f"{label(o)}: {key} differs from the base"
        assert o["spec"]["template"]["spec"]["hostNetwork"] is True and lc["imagePullPolicy"] == "Never"
    base_settings = of_kind(base, "ConfigMap")[0]["data"]
    local_settings = of_kind(local, "ConfigMap")[0]["data"]
    changed = {k for k in base_settings.keys() | local_settings.keys() if base_settings.get(k) != local_settings.get(k)}
    assert changed == {"LLMB_WEB_BIND", "LLMB_METRICS_BIND"}, changed
    assert {o["kind"] for o in local} <= {"ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment"}


def test_manifests_are_plain_yaml() -> None:
    """Every file under deploy/kubernetes parses (a file kustomize does not list is still read by people)."""
    for path in sorted(Path(OVERLAYS["base"]).parent.rglob("*.yaml")):
        list(yaml.safe_load_all(path.read_text()))


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_first_apply_holds_what_the_migration_needs(overlay: str) -> None:
    """`kubectl apply -k DIR -l 'app.kubernetes.io/component in (settings,migrate)'` (docs/operations.md#kubernetes)
    selects the migration Job and the ConfigMap and Secret it reads, and no process."""
    objs = objects(overlay)
    first = [o for o in objs if o["metadata"].get("labels", {}).get("app.kubernetes.io/component")
             in ("settings", "migrate")]
    assert sorted(o["kind"] for o in first) == ["ConfigMap", "Job", "Secret"], [label(o) for o in first]
    job = named(first, "Job", "llmb-migrate")["spec"]["template"]["spec"]["containers"][0]
    environment(first, job)  # its envFrom resolves within the first apply


@pytest.mark.parametrize(("kind", "model", "configured", "name"), [
    ("sim", None, "", "sim"), ("sim-lm", "sim-lm", "ignored", "sim-lm"), ("hf-embed", None, "", "all-MiniLM-L6-v2"),
    ("hf-embed", "/models/e5-small/", "", "e5-small"),
    ("hf-causal", "Qwen/Qwen2.5-0.5B-Instruct", "", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("hf-causal", "Qwen/Qwen2.5-0.5B-Instruct", "qwen", "qwen")])
def test_served_name(kind: str, model: str | None, configured: str, name: str) -> None:
    """The name the ScaledObjects' queries are checked against is the one the worker serves."""
    from gpu_worker.backends.registry import served_name

    assert served_name(kind, model, configured) == name
