"""``GET /openapi.json`` held to the app two ways.

The document names every route the app serves and nothing else (compared with Flask's own URL map, so a new
route without its entry fails here). And Schemathesis, the property-based tester teams point at an OpenAPI
document, sends every operation its generated cases (examples, coverage, fuzzing and the stateful phase that
follows the document's links) to the real system as shipped: gunicorn, a batcher and a sim-lm worker, API keys
on. Every check must pass: no 5xx but the documented 503 and 504, every status and body as documented,
schema-valid requests accepted and invalid ones refused, auth enforced. Beside it a healthy caller of another
tenant, on one pooled connection, must get nothing but 200s.
"""
from __future__ import annotations

import re
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.stack import BIN, ROOT, Stack, running_stack
from tasks.config import Settings
from webapp import create_app, openapi

FLASK_PARAM = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")  # <file_id>, <int:n> -> {file_id}, {n}


def test_the_document_names_every_route_the_app_serves_and_no_other(tmp_path: Path) -> None:
    settings = Settings.from_env(overrides={"auth": "none", "database_url": f"sqlite:///{tmp_path / 'db'}",
                                            "files_dir": str(tmp_path / "files")})
    app = create_app(settings)
    served = {(FLASK_PARAM.sub(r"{\1}", rule.rule), method.lower())
              for rule in app.url_map.iter_rules() for method in rule.methods or () if method not in
              ("HEAD", "OPTIONS")}
    document = openapi.document("test", settings)
    documented = {(path, method) for path, operations in document["paths"].items() for method in operations}
    assert served == documented
    ids = [op["operationId"] for operations in document["paths"].values() for op in operations.values()]
    assert len(ids) == len(set(ids))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # the default model is the one the worker serves, so generated calls reach it; a small token cap (the
    # document says it) keeps each generated call short
    with running_stack(Path(tmp_path_factory.mktemp("openapi")), workers=[(0, {"backend": "sim-lm"})],
                       auth="keys", default_model="sim-lm", max_tokens_cap=32) as s:
        yield s


class HealthyCaller(threading.Thread):
    """One tenant's steady completions on one pooled connection (requests.Session, no retries)."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.stopped = url, key, threading.Event()
        self.statuses: Counter[int | str] = Counter()

    def run(self) -> None:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {self.key}"
            while not self.stopped.is_set():
                try:
                    answer = session.post(self.url + "/v1/completions", timeout=30,
                                          json={"model": "sim-lm", "prompt": "steady", "max_tokens": 4})
                    self.statuses[answer.status_code] += 1
                except requests.RequestException as exc:
                    self.statuses[type(exc).__name__] += 1
                self.stopped.wait(0.2)


def test_schemathesis_finds_nothing_and_the_healthy_caller_beside_it_is_unaffected(fuzzed: Stack) -> None:
    admin_key = fuzzed.admin("keys", "create", "fuzzer", "--admin").stdout.strip()
    healthy = HealthyCaller(fuzzed.url, fuzzed.admin("keys", "create", "healthy").stdout.strip())
    healthy.start()
    try:
        run = subprocess.run(
            [str(BIN / "schemathesis"), "--config-file", str(ROOT / "tests" / "schemathesis.toml"), "run",
             fuzzed.url + "/openapi.json", "--checks", "all", "--max-examples", "40",
             "--generation-deterministic",  # the same cases every run, so CI is repeatable; explore by hand
             "-H", f"Authorization: Bearer {admin_key}", "--request-timeout", "60",
             "--no-color"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        healthy.stopped.set()
        healthy.join(timeout=40)
    print(run.stdout[-4000:])  # the summary: operations, phases, cases generated
    assert run.returncode == 0, f"schemathesis failed ({run.returncode}):\n{run.stdout[-30000:]}\n{run.stderr}"
    assert " passed" in run.stdout, run.stdout[-4000:]
    assert healthy.statuses and set(healthy.statuses) == {200}, healthy.statuses
