"""Every error in the JSON shape of its route family (webapp.errors), never a 500 where a 4xx or 503 is meant.

The Flask app in process, on the real Redis and RabbitMQ (a private Redis where it must go away): routing's 404 and
405 and an unexpected exception on the OpenAI and Batch API routes in OpenAI's shape, on the native routes in the
native one; the admin routes' 400 for a weight no float holds and 503 (not 500) while Redis is away; and the one
table of domain errors' statuses (every type of tasks.errors in it, each with the status it had).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from harness.services import PrivateRedis
from tasks import errors
from tasks.config import Settings
from tasks.errors import BatchingError
from tasks.gateway import readiness
from tasks.store.models import Base, make_engine
from webapp import batch_api, create_app
from webapp.errors import NATIVE, OPENAI, STATUSES, shape_for, status_of
from webapp.services import services

SECRET = "a detail only the server log may hold"


def make_app(tmp_path: Path, **overrides: object) -> Flask:
    database_url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(database_url))  # keys, tenants and the Batch API's tables
    settings = Settings.from_env(overrides={"auth": "none", "namespace": f"es{time.monotonic_ns()}",
                                            "database_url": database_url, "web_workers": 1,
                                            "files_dir": str(tmp_path / "files"), **overrides})
    return create_app(settings)


@pytest.fixture
def app(tmp_path: Path) -> Flask:
    return make_app(tmp_path)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def admin_headers(app: Flask) -> dict[str, str]:
    return {"Authorization": f"Bearer {services(app).keys.create_key('ops', admin=True)[1]}"}


def clean(response: Any, status: int, *, openai: bool) -> dict[str, Any]:
    """The error of a JSON answer of ``status`` in its family's shape, with no trace of the server's insides."""
    assert response.status_code == status, response.data[:300]
    assert response.headers["Content-Type"].startswith("application/json"), response.data[:300]
    error: dict[str, Any] = response.get_json()["error"]
    keys = {"message", "type", "param", "code"} if openai else {"message", "type", "request_id"}
    assert set(error) == keys and error["message"]
    assert "Traceback" not in response.text and SECRET not in response.text
    return error


# -- the families, pure ---------------------------------------------------------------------------------------
def test_every_route_of_the_app_is_in_the_family_its_blueprint_answers_in(app: Flask) -> None:
    """The OpenAI, Batch API, Responses and vLLM-adapter blueprints' routes are OpenAI's by path, every other route
    native: an error found before (or without) a blueprint is written as the blueprint would have."""
    for rule in app.url_map.iter_rules():
        path = rule.rule.replace("<", "").replace(">", "")
        openai = rule.endpoint.split(".")[0] in ("openai", "batch", "responses", "lora_adapters")
        assert shape_for(path) is (OPENAI if openai else NATIVE), rule.rule
        assert shape_for(path + "/unknown") is shape_for(path), rule.rule


@pytest.mark.parametrize(("path", "openai"), [
    ("/v1/chat/completions", True), ("/v1/chat", True), ("/v1/responses", True), ("/v1/audio/speech", True),
    ("/v1/infer", False), ("/v1/inference", True), ("/v1/requests/x", False), ("/v1/admin", False),
    ("/healthz", False), ("/", False), ("/v2/anything", False),
])
def test_shape_for_a_path(path: str, openai: bool) -> None:
    assert shape_for(path) is (OPENAI if openai else NATIVE)


# -- routing's 404 and 405 --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/batches/nope", 404), ("GET", "/v1/batches/nope/extra", 404), ("GET", "/v1/files/a/b/c", 404),
    ("GET", "/v1/models/sim/more", 404), ("POST", "/v1/audio/speech", 404), ("DELETE", "/v1/chat/completions", 405),
    ("GET", "/v1/completions", 405), ("PUT", "/v1/models", 405), ("PATCH", "/v1/batches", 405),
    ("DELETE", "/v1/embeddings", 405),
])
def test_openai_and_batch_routes_answer_404_and_405_in_openai_shape(client: FlaskClient, method: str, path: str,
                                                                     status: int) -> None:
    error = clean(client.open(path, method=method), status, openai=True)
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert error["code"] == {404: "not_found", 405: "method_not_allowed"}[status]


def test_a_405_names_what_the_path_takes(client: FlaskClient) -> None:
    answer = client.delete("/v1/chat/completions")
    assert "POST" in answer.headers["Allow"] and "it takes OPTIONS, POST" in answer.get_json()["error"]["message"]


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nothing/here/at/all", 404), ("DELETE", "/v1/infer", 405), ("POST", "/v1/requests/x", 405),
    ("GET", "/nowhere", 404),
])
def test_native_routes_keep_the_native_shape(client: FlaskClient, method: str, path: str, status: int) -> None:
    if path.startswith("/v1/nothing"):  # not a native route: the openai client is the likelier caller
        clean(client.open(path, method=method), status, openai=True)
        return
    error = clean(client.open(path, method=method), status, openai=False)
    assert error["type"] == {404: "not_found", 405: "method_not_allowed"}[status]


# -- an unexpected exception --------------------------------------------------------------------------------
def _boom(*args: object, **kwargs: object) -> Any:
    raise RuntimeError(SECRET)


def test_an_unexpected_exception_is_a_500_in_its_familys_shape_without_its_details(
        app: Flask, client: FlaskClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services(app).gateway, "live_workers", _boom)
    monkeypatch.setattr(readiness, "ping", _boom)
    monkeypatch.setattr(batch_api, "_stores", _boom)
    for path in ("/v1/models", "/v1/files", "/v1/batches/batch_x"):
        error = clean(client.get(path), 500, openai=True)
        assert (error["type"], error["code"]) == ("server_error", "internal_error")
    error = clean(client.post("/v1/chat/completions", json={"model": "sim-lm", "messages": [
        {"role": "user", "content": "hi"}]}), 500, openai=True)
    assert error["type"] == "server_error"
    assert clean(client.get("/readyz"), 500, openai=False)["type"] == "internal_error"


# -- the admin routes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", ['{"weight": ' + "9" * 400 + "}", '{"weight": -' + "9" * 400 + "}",
                                  '{"max_in_flight": ' + "9" * 400 + "}", '{"weight": 1e400}'])
def test_a_number_too_large_for_its_column_is_a_400_saying_the_range(app: Flask, client: FlaskClient,
                                                                     body: str) -> None:
    answer = client.put("/v1/admin/tenants/X", data=body, content_type="application/json",
                        headers=admin_headers(app))
    error = clean(answer, 400, openai=False)
    assert error["type"] == "invalid_request" and "must be" in error["message"] and len(error["message"]) < 200
    assert client.get("/v1/admin/tenants", headers=admin_headers(app)).get_json()["tenants"] == [
        {"name": "ops", "weight": 1.0, "max_in_flight": 5000, "priority": "interactive", "in_flight": 0}]


def test_admin_routes_answer_503_while_redis_is_away(tmp_path: Path, private_redis: PrivateRedis) -> None:
    app = make_app(tmp_path, redis_url=private_redis.url)
    client, headers = app.test_client(), admin_headers(app)
    assert client.get("/v1/admin/tenants", headers=headers).status_code == 200
    private_redis.kill()
    for path in ("/v1/admin/tenants", "/v1/admin/stats"):
        error = clean(client.get(path, headers=headers), 503, openai=False)
        assert error["type"] == "unavailable" and "Redis is unreachable" in error["message"]


# What each error class said of itself before errors were types: the table must answer the same.
STATUS_BEFORE = {"invalid_request": 400, "context_length_exceeded": 400, "unauthorized": 401, "forbidden": 403,
                 "quota_exceeded": 403, "not_found": 404, "model_not_found": 404, "idempotency_conflict": 409,
                 "idempotency_in_progress": 409, "not_resumable": 409, "record_unreadable": 409,
                 "payload_too_large": 413, "poison_input": 422, "queue_full": 429, "tenant_over_limit": 429,
                 "overloaded": 429, "internal_error": 500, "inference_failed": 500, "unavailable": 503,
                 "retries_exhausted": 503, "deadline_exceeded": 504, "insufficient_storage": 507}
# ... and of the types added since
STATUS_SINCE = {"adapter_conflict": 409, "adapter_limit": 403}


def test_every_error_type_has_its_status_in_the_one_table() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, BatchingError)]
    assert len({c.type for c in classes}) == len(classes), "one class per type"
    assert {c.type for c in classes} == set(errors.TYPES) == set(STATUSES)
    assert STATUSES == STATUS_BEFORE | STATUS_SINCE
    assert not [c for c in classes if "status" in vars(c)], "domain errors carry no HTTP status"
    assert status_of("a newer version's type") == 500


def test_every_error_class_lives_in_tasks_errors(app: Flask) -> None:
    """The app (and so every blueprint, and the jobs' line runner) imported: no error class is defined elsewhere."""
    import webapp.jobs  # noqa: F401  (the one error-raising module the app does not import)

    def subclasses(cls: type[BatchingError]) -> list[type[BatchingError]]:
        return [cls, *(s for direct in cls.__subclasses__() for s in subclasses(direct))]

    assert {c.__module__ for c in subclasses(BatchingError)} == {"tasks.errors"}


def test_a_replayed_error_is_its_types_class_with_its_first_calls_id() -> None:
    error = errors.error_of_type("tenant_over_limit", "over", replay_of="first")
    assert type(error) is errors.TenantOverLimit and error.message == "over" and error.replay_of == "first"
    unknown = errors.error_of_type("a newer version's type", "why")
    assert type(unknown) is BatchingError and unknown.type == "internal_error" and unknown.message == "why"


def test_revoking_an_unknown_key_is_a_404_and_a_lost_table_a_503_in_each_familys_shape(app: Flask,
                                                                                      client: FlaskClient) -> None:
    headers = admin_headers(app)
    error = clean(client.delete("/v1/admin/keys/k-none", headers=headers), 404, openai=False)
    assert (error["type"], error["message"]) == ("not_found", "no active key with id 'k-none'")
    with services(app).keys.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE batch_jobs")
    error = clean(client.get("/v1/batches", headers=headers), 503, openai=True)
    assert error == {"message": "the database is unreachable: OperationalError", "type": "service_unavailable",
                     "param": None, "code": "unavailable"}
