"""LoRA adapters end to end (issue 44): real gunicorn, batcher, sim-lm worker and llmb-jobs processes, keys on.
Adapters are registered with `llmb-admin adapters` and vLLM's POST /v1/load_lora_adapter (PEFT directories the test
writes); a call naming one on every route (the openai client and a requests.Session, retries off) is answered with
the adapter's name, and its items reach the worker with the adapter in their params (the ledger's adapter column,
written from the items the worker ran); another tenant's private adapter is a 404 exactly as an unknown model's;
/v1/models lists the adapters with their parent; removal takes effect within LLMB_ADAPTER_CACHE_S; a flood of
registrations stops at LLMB_MAX_REGISTERED_ADAPTERS. sim-lm itself may ignore the adapter."""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from requests.adapters import HTTPAdapter
from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.adapters import write_lora
from harness.stack import Stack, running_stack, wait_for
from tasks.store.models import RequestRecord, make_engine

LM = "sim-lm"
BOUND = 6
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tmp_path_factory.mktemp("adapters"))
    with running_stack(tmp, workers=[(0, {"backend": "sim-lm"})], jobs=("jobs",), auth="keys", auth_cache_s=0.5,
                       adapter_cache_s=0.5, max_registered_adapters=BOUND, files_dir=tmp / "files", jobs_poll_s=0.2,
                       sim_lm_speed=20, offline_max_wait_ms=50, default_model=LM, store_inputs="true") as s:
        yield s


def new_key(stack: Stack, tenant: str, *args: str) -> str:
    return stack.admin("keys", "create", tenant, *args).stdout.strip()


@pytest.fixture(scope="module")
def keys(stack: Stack) -> dict[str, str]:
    return {"admin": new_key(stack, "ops", "--admin"), "a": new_key(stack, "team-a"), "b": new_key(stack, "team-b")}


@pytest.fixture(scope="module")
def http() -> requests.Session:
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=0))
    return session


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def adapters(stack: Stack, keys: dict[str, str], http: requests.Session,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared`` registered with the CLI; team-a's ``a-private`` (pinned) with vLLM's route, base by default."""
    root = Path(tmp_path_factory.mktemp("loras"))
    shared, private = write_lora(root / "shared", rank=8), write_lora(root / "private", rank=16, seed=1)
    added = stack.admin("adapters", "add", "shared", "--base", LM, "--path", str(shared))
    assert "registered shared: base sim-lm, rank 8, every tenant" in added.stdout
    r = http.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": "a-private", "lora_path": str(private),
                                                            "tenant": "team-a", "pinned": True},
                  headers=auth(keys["admin"]), timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["base_model"] == LM and r.json()["rank"] == 16, r.text
    listed = json.loads(stack.admin("adapters", "list", "--json").stdout)
    assert [(a["name"], a["tenant"], a["pinned"]) for a in listed] == [("a-private", "team-a", True),
                                                                      ("shared", None, False)]
    return {"shared": shared, "a-private": private}


def ledger_rows(stack: Stack, request_id: str, items: int = 1) -> list[RequestRecord]:
    """The ledger's rows of the call ``request_id`` (written once its batch ran on the worker)."""
    query = select(RequestRecord).where(RequestRecord.correlation_id == request_id)
    engine = make_engine(stack.database_url)

    def rows() -> list[RequestRecord] | None:
        with Session(engine) as s:
            found = list(s.scalars(query))
        return found if len(found) >= items and all(r.status == "ok" for r in found) else None

    return wait_for(rows, 20, f"the ledger rows of {request_id}")


def assert_ran_with(stack: Stack, request_id: str, adapter: str, path: Path) -> None:
    for row in ledger_rows(stack, request_id):
        params = json.loads(row.params or "{}")
        assert (row.model, row.adapter, params.get("adapter_path")) == (LM, adapter, str(path)), row.params


def test_every_route_answers_an_adapter_call_in_its_name_and_runs_it_with_the_adapter(
        stack: Stack, keys: dict[str, str], adapters: dict[str, Path], http: requests.Session) -> None:
    c = client(stack, keys["a"])
    for name in ("a-private", "shared"):
        raw = c.completions.with_raw_response.create(model=name, prompt="the cat", max_tokens=4, temperature=0)
        assert raw.parse().model == name and raw.parse().choices[0].text
        assert_ran_with(stack, raw.headers["x-request-id"], name, adapters[name])
    raw_chat = c.chat.completions.with_raw_response.create(
        model="a-private", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert raw_chat.parse().model == "a-private"
    assert_ran_with(stack, raw_chat.headers["x-request-id"], "a-private", adapters["a-private"])
    chunks = list(c.chat.completions.create(model="a-private", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True))
    assert chunks and {k.model for k in chunks} == {"a-private"}
    pieces = list(c.completions.create(model="shared", prompt="x", max_tokens=4, stream=True))
    assert pieces and {k.model for k in pieces} == {"shared"}
    raw_resp = c.responses.with_raw_response.create(model="a-private", input="the cat sat", max_output_tokens=4)
    assert raw_resp.parse().model == "a-private"
    assert_ran_with(stack, raw_resp.headers["x-request-id"], "a-private", adapters["a-private"])
    with pytest.raises(openai.BadRequestError, match="causal model"):  # sim-lm is no embedding model
        c.embeddings.create(model="shared", input="x")
    native = http.post(stack.url + "/v1/infer", json={"model": "a-private", "inputs": ["a", "b"]},
                       headers=auth(keys["a"]), timeout=TIMEOUT_S)
    assert native.status_code == 200 and len(native.json()["outputs"]) == 2, native.text
    assert len(ledger_rows(stack, native.headers["x-request-id"], items=2)) == 2
    assert_ran_with(stack, native.headers["x-request-id"], "a-private", adapters["a-private"])
    again = http.get(stack.url + f"/v1/requests/{raw_chat.headers['x-request-id']}", headers=auth(keys["a"]),
                     timeout=TIMEOUT_S).json()
    assert again["model"] == "a-private" and again["response"]["body"]["model"] == "a-private"


def test_replay_sends_an_adapters_calls_again_with_their_adapter(stack: Stack, keys: dict[str, str],
                                                                  adapters: dict[str, Path]) -> None:
    c = client(stack, keys["b"])
    raw = c.completions.with_raw_response.create(model="shared", prompt="replay me", max_tokens=3, temperature=0)
    first = ledger_rows(stack, raw.headers["x-request-id"])[0]
    since = ("--since", first.accepted_at.isoformat())  # (SQLite gives it back naive: it is UTC)
    assert "would replay 1 request" in stack.admin("replay", "--adapter", "shared", "--tenant", "team-b", *since,
                                                   "--dry-run").stdout
    assert "replayed 1 ok" in stack.admin("replay", "--adapter", "shared", "--tenant", "team-b", *since).stdout
    again = ledger_rows(stack, f"replay-{first.id}")[0]
    assert (again.adapter, again.model, again.params) == ("shared", LM, first.params)


def test_a_batch_line_naming_an_adapter_is_answered_in_its_name(stack: Stack, keys: dict[str, str],
                                                                adapters: dict[str, Path]) -> None:
    c = client(stack, keys["a"])
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": name, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3}}
             for i, name in enumerate(("a-private", "shared", "a-private"))]
    upload = c.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    found: list[Any] = []

    def ended() -> bool:
        found[:] = [c.batches.retrieve(batch.id)]
        return found[0].status in ("completed", "failed", "cancelled", "expired")

    wait_for(ended, 60, f"batch {batch.id} to end")
    assert found[0].status == "completed" and found[0].output_file_id, found[0]
    out = {x["custom_id"]: x["response"] for x in map(json.loads, c.files.content(found[0].output_file_id)
                                                      .text.splitlines())}
    assert {k: (v["status_code"], v["body"]["model"]) for k, v in out.items()} == {
        "c0": (200, "a-private"), "c1": (200, "shared"), "c2": (200, "a-private")}
    query = select(RequestRecord).where(RequestRecord.correlation_id.like(f"{batch.id}-%"))
    with Session(make_engine(stack.database_url)) as s:
        ran = sorted((r.adapter, json.loads(r.params or "{}").get("adapter_path")) for r in s.scalars(query))
    assert ran == [("a-private", str(adapters["a-private"]))] * 2 + [("shared", str(adapters["shared"]))]


def test_another_tenants_private_adapter_is_a_404_as_an_unknown_model(stack: Stack, keys: dict[str, str],
                                                                      adapters: dict[str, Path],
                                                                      http: requests.Session) -> None:
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                        ("/v1/completions", {"prompt": "x"})):
        private = http.post(stack.url + route, json={"model": "a-private", **body}, headers=auth(keys["b"]),
                            timeout=TIMEOUT_S)
        unknown = http.post(stack.url + route, json={"model": "b-never", **body}, headers=auth(keys["b"]),
                            timeout=TIMEOUT_S)
        assert private.status_code == unknown.status_code == 404
        assert json.loads(private.text.replace("a-private", "b-never")) == unknown.json()
    with pytest.raises(openai.NotFoundError, match="not served"):
        client(stack, keys["b"]).completions.create(model="a-private", prompt="x", max_tokens=2)
    # the shared one is everyone's
    assert client(stack, keys["b"]).completions.create(model="shared", prompt="x", max_tokens=2).model == "shared"


def test_models_lists_the_adapters_each_tenant_may_use_with_their_parent(stack: Stack, keys: dict[str, str],
                                                                         adapters: dict[str, Path],
                                                                         http: requests.Session) -> None:
    def listed(key: str) -> dict[str, dict[str, Any]]:
        r = http.get(stack.url + "/v1/models", headers=auth(key), timeout=TIMEOUT_S)
        assert r.status_code == 200
        return {m["id"]: m for m in r.json()["data"]}

    mine = listed(keys["a"])
    assert set(mine) == {LM, "shared", "a-private"}
    assert (mine["a-private"]["parent"], mine["a-private"]["root"]) == (LM, str(adapters["a-private"]))
    assert set(listed(keys["b"])) == {LM, "shared"}
    assert {m.id for m in client(stack, keys["a"]).models.list()} == {LM, "shared", "a-private"}


def test_load_unload_and_the_cli_take_effect_without_a_restart(stack: Stack, keys: dict[str, str],
                                                               adapters: dict[str, Path], http: requests.Session,
                                                               tmp_path: Path) -> None:
    c, root = client(stack, keys["a"]), auth(keys["admin"])
    lora = write_lora(tmp_path / "new", rank=4)
    r = http.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(lora)},
                  headers=root, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    # every API process serves it within LLMB_ADAPTER_CACHE_S (0.5 s here; two gunicorn workers)
    def served() -> bool:  # a 404 until this API process's catalog is read again: polled, not raised
        # the session and the openai client each hold their own pooled connection, which may reach a different
        # gunicorn process: both must see the adapter
        by_session = all(http.post(stack.url + "/v1/completions",
                                   json={"model": "fresh", "prompt": "x", "max_tokens": 2},
                                   headers=auth(keys["a"]), timeout=TIMEOUT_S).status_code == 200 for _ in range(4))
        try:
            return by_session and c.completions.create(model="fresh", prompt="x", max_tokens=2).model == "fresh"
        except openai.NotFoundError:
            return False

    wait_for(served, 10, "the new adapter to be served by every API process")
    r = http.post(stack.url + "/v1/unload_lora_adapter", json={"lora_name": "fresh"}, headers=root,
                  timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text

    def gone() -> bool:
        return all(http.post(stack.url + "/v1/completions", json={"model": "fresh", "prompt": "x"},
                             headers=auth(keys["a"]), timeout=TIMEOUT_S).status_code == 404 for _ in range(4))

    wait_for(gone, 10, "the unloaded adapter to stop being served")
    assert http.post(stack.url + "/v1/unload_lora_adapter", json={"lora_name": "fresh"}, headers=root,
                     timeout=TIMEOUT_S).status_code == 404
    assert http.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(lora)},
                     headers=auth(keys["a"]), timeout=TIMEOUT_S).status_code == 403  # not an admin key
    stack.admin("adapters", "add", "by-cli", "--base", LM, "--path", str(lora), "--tenant", "team-a")
    wait_for(lambda: http.post(stack.url + "/v1/completions", json={"model": "by-cli", "prompt": "x"},
                               headers=auth(keys["a"]), timeout=TIMEOUT_S).status_code == 200, 10, "the CLI's adapter")
    assert "removed by-cli" in stack.admin("adapters", "remove", "by-cli").stdout
    wait_for(lambda: http.post(stack.url + "/v1/completions", json={"model": "by-cli", "prompt": "x"},
                               headers=auth(keys["a"]), timeout=TIMEOUT_S).status_code == 404, 10, "its removal")


def test_a_flood_of_registrations_stops_at_the_bound(stack: Stack, keys: dict[str, str], adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    lora, before = write_lora(tmp_path / "flood"), len(json.loads(stack.admin("adapters", "list", "--json").stdout))

    def load(i: int) -> tuple[int, str]:
        with requests.Session() as session:
            session.mount("http://", HTTPAdapter(max_retries=0))
            r = session.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": f"flood-{i}",
                                                                         "lora_path": str(lora)},
                             headers=auth(keys["admin"]), timeout=TIMEOUT_S)
            return r.status_code, r.json().get("error", {}).get("code", "")

    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(load, range(30)))
    assert outcomes.count((200, "")) == BOUND - before
    assert outcomes.count((403, "adapter_limit")) == 30 - (BOUND - before), outcomes
    assert len(json.loads(stack.admin("adapters", "list", "--json").stdout)) == BOUND
    refused = stack.admin("adapters", "add", "one-more", "--base", LM, "--path", str(lora), check=False)
    assert refused.returncode != 0 and "LLMB_MAX_REGISTERED_ADAPTERS" in refused.stderr
    for i in range(30):
        stack.admin("adapters", "remove", f"flood-{i}", check=False)
    assert len(json.loads(stack.admin("adapters", "list", "--json").stdout)) == before
