"""/metrics names every tenant (their calls in flight, their refusals), so an operator can serve it on an internal
listener of its own (``LLMB_METRICS_BIND``): there it answers with every API process's figures, and the public
port's /metrics is a 404. Unset, it is served on the API port as before."""
from __future__ import annotations

from pathlib import Path

import requests

from harness.stack import free_port, running_stack, wait_for


def total(text: str, name: str) -> float:
    """The sum of a counter's samples in a /metrics page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_metrics_on_their_own_listener_count_every_api_process_and_the_public_port_has_none(tmp_path: Path) -> None:
    internal = f"http://127.0.0.1:{free_port()}"
    with running_stack(tmp_path, web_workers=2, metrics_bind=internal.removeprefix("http://"),
                       tenant_max_in_flight=3) as s, requests.Session() as http:
        for i in range(6):  # new connections: spread over both API processes
            assert requests.post(s.url + "/v1/infer", json={"input": f"x{i}"}, timeout=30).status_code == 200
        assert http.post(s.url + "/v1/infer", json={"inputs": ["a", "b", "c", "d"]}, timeout=30).status_code == 429
        assert http.get(s.url + "/metrics", timeout=10).status_code == 404
        for _ in range(4):  # whichever worker answers a scrape, every process's calls are in it
            page = requests.get(internal + "/metrics", timeout=10)
            assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/plain")
            assert total(page.text, "llmb_http_requests_total") == 7, page.text[:2000]
            assert 'llmb_tenant_refusals_total{tenant="default"' in page.text


def test_without_a_metrics_bind_the_api_port_serves_them(tmp_path: Path) -> None:
    with running_stack(tmp_path, web_workers=1) as s:
        assert requests.post(s.url + "/v1/infer", json={"input": "x"}, timeout=30).status_code == 200
        wait_for(lambda: total(requests.get(s.url + "/metrics", timeout=10).text, "llmb_http_requests_total") == 1,
                 10, "the call counted on the API port's /metrics")
