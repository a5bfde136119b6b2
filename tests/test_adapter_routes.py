"""Every route resolves a LoRA adapter's name the same way (issue 44), in one API process with keys on and a fleet
made up (its gateway's fleet and submit replaced; nothing is run): the call reaching the gateway is its base
model's with the adapter in its params, the answer names the adapter, another tenant's private adapter is the 404
of an unknown model, an embedding adapter needs an embedding base, /v1/models lists what the tenant may use, and
vLLM's load and unload routes register and remove adapters for an admin key. The same through real processes:
tests/test_adapters_e2e.py."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from harness.adapters import write_lora
from tasks.config import Settings
from tasks.gateway.calls import Answer, Call
from tasks.schema import ItemResult, WorkerInfo
from tasks.state.records import Shape
from tasks.store.jobs import JobInfo, Line
from tasks.store.models import Base, make_engine
from tasks.store.tenants import KeyStore
from webapp import create_app
from webapp.jobs import LineRunner
from webapp.services import services

LM, EMBED = "sim-lm", "embedder"


def worker(model: str, kind: str) -> WorkerInfo:
    return WorkerInfo(id=f"{model}@test", queue=f"q.{model}", model=model, max_batch=8, state="idle", outstanding=0,
                      completed=0, batch_started_at=None, batch_ms_estimate=10.0, heartbeat_at=time.time(),
                      kind=kind)


class Fleet:
    """The gateway's fleet and submit, made up: every call submitted is kept, and answered at once."""

    def __init__(self, models: dict[str, str]) -> None:
        self.models = models
        self.calls: list[Call] = []

    def live_workers(self, fresh: bool = False) -> list[WorkerInfo]:
        return [worker(m, k) for m, k in self.models.items()]

    def submit(self, call: Call, shape: Shape | None = None, **_: Any) -> Answer:
        self.calls.append(call)
        if self.models.get(call.model) == "embed":
            output: Any = {"embedding": [0.5, 0.25], "prompt_tokens": 1}
        elif call.params.max_tokens is None:
            output = f"out:{call.inputs[0]}"
        else:
            output = {"text": "hello", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1}
        results = tuple(ItemResult(output=output, batch_id="b1", batch_size=1) for _ in call.inputs)
        return Answer(results=results, accepted_at=time.time(), request_id=call.request_id)


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Flask:
    settings = Settings.from_env(overrides={"auth": "keys", "database_url": f"sqlite:///{tmp_path / 'db'}",
                                            "files_dir": str(tmp_path / "files"), "adapter_cache_s": "0.2",
                                            "namespace": f"t{uuid.uuid4().hex[:10]}", "default_model": LM})
    Base.metadata.create_all(make_engine(settings.stores.database_url))
    app = create_app(settings)
    fleet = Fleet({LM: "causal", EMBED: "embed"})
    gateway = services(app).gateway
    monkeypatch.setattr(gateway, "live_workers", fleet.live_workers)
    monkeypatch.setattr(gateway, "submit", fleet.submit)
    app.extensions["test.fleet"] = fleet
    return app


def key(app: Flask, tenant: str, *, admin: bool = False) -> dict[str, str]:
    _, made = KeyStore.from_settings(services(app).settings).create_key(tenant, admin=admin)
    return {"Authorization": f"Bearer {made}"}


def calls(app: Flask) -> list[Call]:
    fleet = app.extensions["test.fleet"]
    assert isinstance(fleet, Fleet)
    return fleet.calls


@pytest.fixture
def registered(app: Flask, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Adapters loaded through vLLM's route: a shared one of the LM, team-a's private one, an embedding one."""
    root = key(app, "ops", admin=True)
    client = app.test_client()
    for body in ({"lora_name": "sql", "lora_path": str(write_lora(tmp_path / "sql"))},  # base: the one LM served
                 {"lora_name": "a-private", "lora_path": str(write_lora(tmp_path / "a", rank=4)), "tenant": "team-a",
                  "pinned": True},
                 {"lora_name": "emb-tuned", "lora_path": str(write_lora(tmp_path / "e")), "base_model": EMBED}):
        r = client.post("/v1/load_lora_adapter", json=body, headers=root)
        assert r.status_code == 200, r.get_json()
    return {"admin": root, "a": key(app, "team-a"), "b": key(app, "team-b")}


def test_every_route_runs_an_adapter_on_its_base_and_names_the_adapter_in_its_answer(
        app: Flask, registered: dict[str, dict[str, str]]) -> None:
    client, a = app.test_client(), registered["a"]
    answers = [
        client.post("/v1/completions", json={"model": "a-private", "prompt": "x", "max_tokens": 2}, headers=a),
        client.post("/v1/chat/completions", json={"model": "sql", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2}, headers=a),
        client.post("/v1/embeddings", json={"model": "emb-tuned", "input": "x"}, headers=a),
        client.post("/v1/responses", json={"model": "sql", "input": "x", "store": False}, headers=a),
    ]
    for r, name in zip(answers, ("a-private", "sql", "emb-tuned", "sql")):
        assert r.status_code == 200, r.get_json()
        assert r.get_json()["model"] == name
    native = client.post("/v1/infer", json={"model": "sql", "input": "x"}, headers=a)
    assert native.status_code == 200 and native.get_json()["output"] == "out:x"
    ran = [(c.model, c.params.adapter, c.params.adapter_pinned, c.tenant) for c in calls(app)]
    assert ran == [(LM, "a-private", True, "team-a"), (LM, "sql", False, "team-a"),
                   (EMBED, "emb-tuned", False, "team-a"), (LM, "sql", False, "team-a"), (LM, "sql", False, "team-a")]
    assert all(c.params.adapter_path and Path(c.params.adapter_path).is_dir() for c in calls(app))
    assert calls(app)[-1].params.to_dict() == {"adapter": "sql", "adapter_path": calls(app)[-1].params.adapter_path}


def test_another_tenants_private_adapter_is_answered_as_an_unknown_model(
        app: Flask, registered: dict[str, dict[str, str]]) -> None:
    client, b = app.test_client(), registered["b"]
    for route, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        private = client.post(route, json={"model": "a-private", **body}, headers=b)
        unknown = client.post(route, json={"model": "never-made", **body}, headers=b)
        assert private.status_code == unknown.status_code == 404
        shown = json.dumps(private.get_json()).replace("a-private", "never-made")
        assert json.loads(shown) == unknown.get_json() and unknown.get_json()["error"]["code"] == "model_not_found"
    assert not calls(app)


def test_an_adapter_serves_only_the_routes_its_base_serves(app: Flask, registered: dict[str, dict[str, str]]) -> None:
    client, a = app.test_client(), registered["a"]
    r = client.post("/v1/embeddings", json={"model": "sql", "input": "x"}, headers=a)
    assert r.status_code == 400
    assert "'sql' is an adapter of 'sim-lm', a causal model" in r.get_json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "emb-tuned", "prompt": "x"}, headers=a)
    assert r.status_code == 400 and "embed model" in r.get_json()["error"]["message"]


def test_models_lists_the_served_models_and_the_adapters_the_tenant_may_use(
        app: Flask, registered: dict[str, dict[str, str]]) -> None:
    client = app.test_client()

    def listed(who: str) -> dict[str, dict[str, Any]]:
        r = client.get("/v1/models", headers=registered[who])
        assert r.status_code == 200
        return {m["id"]: m for m in r.get_json()["data"]}

    mine = listed("a")
    assert list(mine) == [EMBED, LM, "a-private", "emb-tuned", "sql"]
    assert mine["sql"]["parent"] == LM and Path(mine["sql"]["root"]).is_dir() and mine["sql"]["object"] == "model"
    assert mine["a-private"]["owned_by"] == "team-a" and "parent" not in mine[LM]
    assert list(listed("b")) == [EMBED, LM, "emb-tuned", "sql"]
    del app.extensions["test.fleet"].models[EMBED]  # its base no longer served: the adapter is not listed
    assert list(listed("b")) == [LM, "sql"]


def test_load_and_unload_need_an_admin_key_and_check_what_they_are_given(
        app: Flask, registered: dict[str, dict[str, str]], tmp_path: Path) -> None:
    client, root, lora = app.test_client(), registered["admin"], str(write_lora(tmp_path / "more"))

    def load(body: dict[str, Any], headers: dict[str, str] = root) -> tuple[int, dict[str, Any]]:
        r = client.post("/v1/load_lora_adapter", json=body, headers=headers)
        return r.status_code, r.get_json()

    assert load({"lora_name": "x", "lora_path": lora}, registered["a"])[0] == 403
    assert load({"lora_name": "x", "lora_path": lora}, {})[0] == 401
    for body, status, words in (({"lora_name": "sql", "lora_path": lora}, 409, "registered already"),
                                ({"lora_name": LM, "lora_path": lora}, 409, "serves"),
                                ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "adapter_config.json"),
                                ({"lora_name": "x"}, 400, "'lora_path'"),
                                ({"lora_name": "x", "lora_path": lora, "pinned": "yes"}, 400, "'pinned'"),
                                ({"lora_name": "x", "lora_path": lora, "rank": 8}, 400, "unknown field"),
                                ({"lora_name": "x", "lora_path": lora, "tenant": "bad name!"}, 400, "tenant")):
        status_got, got = load(body)
        assert status_got == status and words in got["error"]["message"], (body, got)
    app.extensions["test.fleet"].models["tiny"] = "causal"  # two generation models: which one is the base?
    status, got = load({"lora_name": "x", "lora_path": lora})
    assert status == 400 and "'base_model'" in got["error"]["message"]
    assert load({"lora_name": "x", "lora_path": lora, "base_model": "tiny"})[0] == 200
    a = registered["a"]
    assert client.post("/v1/completions", json={"model": "x", "prompt": "p"}, headers=a).status_code == 200
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=root)
    assert r.status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=root).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=a).status_code == 403
    # this process serves the change at once (it refreshed its catalog); another within LLMB_ADAPTER_CACHE_S
    assert client.post("/v1/completions", json={"model": "x", "prompt": "p"}, headers=a).status_code == 404


def test_a_batch_line_naming_an_adapter_runs_as_its_route_would(
        app: Flask, registered: dict[str, dict[str, str]]) -> None:
    runner = LineRunner(services(app))
    job = JobInfo(id="batch_x", tenant="team-a", endpoint="/v1/chat/completions", input_file_id="f",
                  completion_window="24h", status="in_progress", metadata=None, errors=None, total=1, completed=0,
                  failed=0, output_file_id=None, error_file_id=None, created_at=0, expires_at=0, in_progress_at=None,
                  finalizing_at=None, completed_at=None, failed_at=None, expired_at=None, cancelling_at=None,
                  cancelled_at=None, lease_owner=None, lease_until=None)
    body = {"model": "a-private", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with app.app_context():
        done = runner(job, Line("batch_x", 0, "c0", "batch_x-c0", json.dumps(body), 0))
        assert done.status_code == 200 and done.body["model"] == "a-private"
        assert calls(app)[-1].model == LM and calls(app)[-1].params.adapter == "a-private"
        other = runner(replace(job, tenant="team-b"),
                       Line("batch_x", 1, "c1", "batch_x-c1", json.dumps(body), 0))
    assert other.status_code == 404 and other.error_type == "model_not_found"
