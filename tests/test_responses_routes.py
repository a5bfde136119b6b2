"""The Responses API's routes in one process, over a store written directly (no workers: nothing is generated):
what they answer for stored responses, another tenant, malformed queries and bodies."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tasks.config import Settings
from tasks.schema import ItemResult
from tasks.store.models import Base, make_engine
from webapp import create_app
from webapp.responses_api import _store
from webapp.responses_schema import new_response_id, response_object


@pytest.fixture
def app(tmp_path: Path) -> Flask:
    settings = Settings.from_env(overrides={"auth": "none", "database_url": f"sqlite:///{tmp_path / 'db'}",
                                            "files_dir": str(tmp_path / "files"),
                                            "namespace": f"t{uuid.uuid4().hex[:10]}"})
    Base.metadata.create_all(make_engine(settings.stores.database_url))
    return create_app(settings)


def stored(app: Flask, *, background: bool = False) -> str:
    rid = new_response_id()
    request = {"model": "sim-lm", "background": background}
    result = None if background else ItemResult(output={"text": "hello there", "finish_reason": "stop"})
    body = response_object(rid, request, time.time(), "queued" if background else "completed", result)
    items = [{"type": "message", "id": f"in_{k}", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
             for k in range(3)]
    with app.app_context():
        _store().save("default", "no-such-call", body, request, items, [])
    return rid


def test_a_stored_response_is_read_listed_replayed_and_deleted_by_its_tenant_only(app: Flask) -> None:
    client: FlaskClient = app.test_client()
    rid = stored(app)
    assert client.get(f"/v1/responses/{rid}").get_json()["output"][0]["content"][0]["text"] == "hello there"
    assert client.get(f"/v1/responses/{rid}", headers={"X-Tenant": "other"}).status_code == 404
    assert client.delete(f"/v1/responses/{rid}", headers={"X-Tenant": "other"}).status_code == 404
    page = client.get(f"/v1/responses/{rid}/input_items?limit=2").get_json()
    assert [i["id"] for i in page["data"]] == ["in_2", "in_1"] and page["has_more"]
    rest = client.get(f"/v1/responses/{rid}/input_items?limit=2&after=in_1").get_json()
    assert [i["id"] for i in rest["data"]] == ["in_0"] and not rest["has_more"]
    assert [i["id"] for i in client.get(f"/v1/responses/{rid}/input_items?order=asc").get_json()["data"]] == \
        ["in_0", "in_1", "in_2"]
    events = [json.loads(line[6:]) for line in client.get(f"/v1/responses/{rid}?stream=true&starting_after=2")
              .get_data(as_text=True).splitlines() if line.startswith("data: ")]
    assert events[0]["sequence_number"] == 3 and events[-1]["type"] == "response.completed"
    assert client.post(f"/v1/responses/{rid}/cancel").status_code == 400  # not a background response
    assert client.delete(f"/v1/responses/{rid}").get_json() == {"id": rid, "object": "response", "deleted": True}
    assert client.get(f"/v1/responses/{rid}").status_code == 404


def test_a_background_response_is_cancelled_and_stays_so(app: Flask) -> None:
    client = app.test_client()
    rid = stored(app, background=True)
    assert client.get(f"/v1/responses/{rid}").get_json()["status"] == "queued"  # its call is not known yet
    assert client.post(f"/v1/responses/{rid}/cancel").get_json()["status"] == "cancelled"
    assert client.get(f"/v1/responses/{rid}").get_json()["status"] == "cancelled"


@pytest.mark.parametrize(("url", "named"), [("?stream=maybe", "'stream'"), ("?starting_after=x", "'starting_after'")])
def test_malformed_queries_are_a_400(app: Flask, url: str, named: str) -> None:
    answer = app.test_client().get(f"/v1/responses/{stored(app)}{url}")
    assert answer.status_code == 400 and named in answer.get_json()["error"]["message"]


@pytest.mark.parametrize(("body", "status", "named"), [
    ({"model": "sim-lm", "input": "x", "foo": 1}, 400, "'foo'"),
    ({"model": "sim-lm", "input": "x", "previous_response_id": "resp_none"}, 404, "previous_response_id"),
    ({"model": "sim-lm", "input": []}, 400, "'input'"),
    ({"model": "sim-lm", "input": "x", "tool_choice": 3}, 400, "'tool_choice'"),
])
def test_a_bad_body_is_refused_before_anything_runs(app: Flask, body: dict[str, object], status: int,
                                                    named: str) -> None:
    answer = app.test_client().post("/v1/responses", json=body)
    assert answer.status_code == status and named in answer.get_json()["error"]["message"]
