"""What an operator pages on and looks at stays true: the alerting rules pass their promtool unit tests, and every
query of the Grafana dashboard runs on a real Prometheus server scraping a running system and names only metrics
it exports (or the rules record)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from harness.stack import Stack, free_port, running_stack, wait_for

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "llmb-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "llmb-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "llmb-dashboard.json"
METRIC = re.compile(r"\bllmb_[a-z_]+\b")
RECORDED = re.compile(r"\bllmb:[a-z0-9_:]+\b")


def tool(name: str) -> str:
    """A Prometheus binary (Debian's `prometheus` package, which bin/test installs)."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: bin/test installs Debian's prometheus package")
        pytest.skip(f"{name} is not installed (apt-get install prometheus; bin/test does)")
    return found


def test_the_rules_are_valid_and_pass_their_unit_tests() -> None:
    promtool = tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                            capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tested_alerts = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
                     for t in case.get("alert_rule_test", ()) if t.get("exp_alerts")}
    assert alerts == tested_alerts, f"alerts without a test that makes them fire: {alerts - tested_alerts}"


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def exported(text: str) -> set[str]:
    """The metric names in a /metrics page (histograms' _bucket, _sum and _count included)."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two models, traffic of both, and a refusal (a call over its tenant's cap), so every series exists."""
    with running_stack(tmp_path_factory.mktemp("monitored"), workers=[0, (1, {"backend": "sim-lm"})],
                       tenant_max_in_flight=3) as s, requests.Session() as http:
        for i in range(5):
            assert http.post(s.url + "/v1/infer", json={"input": f"x{i}"}, timeout=30).status_code == 200
        chat: dict[str, Any] = {"model": "sim-lm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        assert http.post(s.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
        over = http.post(s.url + "/v1/infer", json={"inputs": ["a", "b", "c", "d"]}, timeout=30)
        assert over.status_code == 429, over.text
        yield s


@pytest.fixture(scope="module")
def prometheus(system: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus server with the rules, scraping the system's /metrics every second."""
    binary = tool("prometheus")
    folder = tmp_path_factory.mktemp("prometheus")
    host = system.url.removeprefix("http://")
    (folder / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "llmb", "metrics_path": "/metrics", "static_configs": [{"targets": [host]}]}],
    }))
    port = free_port()
    with open(folder / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: requests.get(url + "/-/ready", timeout=2).status_code == 200, 30, "Prometheus ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_every_dashboard_query_names_exported_metrics_and_runs_on_prometheus(system: Stack, prometheus: str) -> None:
    names = exported(requests.get(system.url + "/metrics", timeout=10).text)
    recorded = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r}
    queries = dashboard_queries()
    used = {m for q in queries for m in METRIC.findall(q)}
    assert used <= names, f"the dashboard names metrics the system does not export: {sorted(used - names)}"
    assert {m for q in queries for m in RECORDED.findall(q)} <= recorded

    def scraped() -> set[str]:
        return set(requests.get(prometheus + "/api/v1/label/__name__/values", timeout=5).json()["data"])

    def rules_ok() -> bool:
        groups = requests.get(prometheus + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) == len(recorded) + len(alerts) and all(r["health"] == "ok" for r in rules)

    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    wait_for(lambda: used <= scraped(), 60, "Prometheus to have scraped every metric the dashboard uses")
    wait_for(rules_ok, 60, "Prometheus to have evaluated every rule without an error")
    for query in queries:
        answer = requests.get(prometheus + "/api/v1/query", params={"query": query}, timeout=5).json()
        assert answer["status"] == "success", (query, answer)

    # a gauge answers from the first scrape (rates need two scrapes of a change, recorded series an evaluation)
    gauges = [q for q in queries if "rate(" not in q and "increase(" not in q and not RECORDED.search(q)]

    def answered(query: str) -> bool:
        found = requests.get(prometheus + "/api/v1/query", params={"query": query}, timeout=5).json()
        return bool(found["data"]["result"])

    for query in gauges:
        wait_for(lambda q=query: answered(q), 30, f"data for {query}")
