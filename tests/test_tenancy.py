"""Tenants end to end, with API keys on: keys, admin routes, per-tenant caps, fairness under a flood, priority.

Real gunicorn, batcher and sim worker processes; keys issued with the real `llmb-admin`.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from harness.helpers import assert_json_error, expected, post
from harness.stack import ROOT, Stack, running_stack, wait_for
from harness.stats import percentile

BATCH_MS = 250  # one sim device, 50 items per 250 ms batch: 200 items/s, a rate the 2-core front door can
CAPACITY = 200  # outrun several times over (past that, a flood queues in the kernel's accept queue, FIFO)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("tenancy")), auth="keys", auth_cache_s=0.5,
                       sim_batch_ms=BATCH_MS, sim_max_batch=50, max_batch_size=50, redis_pool_size=50) as s:
        yield s


def new_key(stack: Stack, tenant: str, *args: str) -> str:
    done = stack.admin("keys", "create", tenant, *args)
    key = done.stdout.strip()
    assert key.startswith("llmb_") and "\n" not in key
    return key


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_valid_key_is_served_and_missing_unknown_or_revoked_ones_get_401(keyed: Stack) -> None:
    key = new_key(keyed, "team-keys")
    r = post(keyed.url, {"input": "hello"}, headers=auth(key))
    assert r.status_code == 200, r.text
    assert r.json()["output"] == expected("hello")

    assert_json_error(post(keyed.url, {"input": "hello"}), 401, "unauthorized")
    assert_json_error(post(keyed.url, {"input": "hello"}, headers={"Authorization": "Basic abc"}), 401)
    assert_json_error(post(keyed.url, {"input": "hello"}, headers=auth("llmb_00000000_" + "x" * 43)), 401)
    assert_json_error(post(keyed.url, {"input": "hello"}, headers=auth("not-a-key")), 401)
    # 401 before the body is looked at, and a key cannot claim another tenant
    assert_json_error(post(keyed.url, data="{broken", headers={"Content-Type": "application/json"}), 401)
    assert_json_error(post(keyed.url, {"input": "x", "tenant": "someone-else"}, headers=auth(key)), 403, "forbidden")

    key_id = json.loads(keyed.admin("keys", "list", "--tenant", "team-keys", "--json").stdout)[0]["id"]
    keyed.admin("keys", "revoke", key_id)
    wait_for(lambda: post(keyed.url, {"input": "hello"}, headers=auth(key)).status_code == 401, 10,
             "the revoked key to stop working (auth cache 0.5 s)")
    assert_json_error(post(keyed.url, {"input": "hello"}, headers=auth(key)), 401, "unauthorized")


def test_admin_routes_need_an_admin_key(keyed: Stack) -> None:
    admin_key = new_key(keyed, "ops", "--admin")
    user_key = new_key(keyed, "team-user")
    url = keyed.url + "/v1/admin"
    assert_json_error(requests.get(url + "/tenants", timeout=10), 401)
    assert_json_error(requests.get(url + "/tenants", headers=auth(user_key), timeout=10), 403, "forbidden")

    made = requests.post(url + "/keys", json={"tenant": "team-api", "label": "ci"}, headers=auth(admin_key),
                         timeout=10)
    assert made.status_code == 201, made.text
    api_key = made.json()["key"]
    assert post(keyed.url, {"input": "via admin api"}, headers=auth(api_key)).status_code == 200
    set_ = requests.put(url + "/tenants/team-api", json={"weight": 2, "max_in_flight": 50},
                        headers=auth(admin_key), timeout=10)
    assert set_.status_code == 200 and set_.json()["weight"] == 2.0, set_.text
    for bad in ({"weight": -1}, {"weight": "2"}, {"max_in_flight": 1.5}, {"weight": 1e308}):
        assert_json_error(requests.put(url + "/tenants/team-api", json=bad, headers=auth(admin_key), timeout=10),
                          400)
    assert_json_error(requests.post(url + "/keys", json={"tenant": "x", "admin": "false"}, headers=auth(admin_key),
                                    timeout=10), 400)
    tenants = requests.get(url + "/tenants", headers=auth(admin_key), timeout=10).json()["tenants"]
    assert {"name": "team-api", "weight": 2.0, "max_in_flight": 50, "priority": "interactive",
            "in_flight": 0} in tenants
    keys = requests.get(url + "/keys", params={"tenant": "team-api"}, headers=auth(admin_key), timeout=10).json()
    assert [k["label"] for k in keys["keys"]] == ["ci"] and "key" not in keys["keys"][0]
    assert requests.delete(url + f"/keys/{made.json()['id']}", headers=auth(admin_key), timeout=10).status_code == 200
    assert_json_error(requests.delete(url + f"/keys/{made.json()['id']}", headers=auth(admin_key), timeout=10), 404)
    wait_for(lambda: post(keyed.url, {"input": "x"}, headers=auth(api_key)).status_code == 401, 10, "revocation")
    stats = requests.get(url + "/stats", headers=auth(admin_key), timeout=10).json()
    assert stats["models"][0]["model"] == "sim" and stats["models"][0]["workers"] == 1


def test_the_autoscaling_signal_is_on_metrics_and_in_the_cli(keyed: Stack) -> None:
    """While a backlog builds, the oldest queued request ages and the recommended worker count rises."""
    from prometheus_client.parser import text_string_to_metric_families

    key = new_key(keyed, "scaler")
    arrived = keyed.arrivals("sim")
    backlog = load(keyed, key, rate=2 * CAPACITY, duration=6, timeout_ms=60_000, seed=31)
    # 5 s of the load's arrivals (2,000 of its ~2,400 requests) have come in, and a backlog of at least 2 s of
    # device time is waiting
    wait_for(lambda: keyed.arrivals("sim") - arrived >= 5 * 2 * CAPACITY and keyed.inflight() >= 2 * CAPACITY, 60,
             "5 s of the load's arrivals and a backlog of 2 s of device time")
    text = requests.get(keyed.url + "/metrics", timeout=10).text
    samples = {(s.name, s.labels.get("model")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    cli = json.loads(keyed.admin("stats", "--interval", "0.2", "--json").stdout)
    records(keyed, backlog, 31)
    assert samples[("llmb_oldest_queued_seconds", "sim")] > 0.5  # callers are waiting on a backlog
    assert samples[("llmb_arrival_rate", "sim")] > 100  # mean of the last 10 s, ~4-5 s of which had arrivals
    assert samples[("llmb_recommended_workers", "sim")] >= 1
    assert samples[("llmb_model_workers", "sim")] == 1
    (row,) = cli["models"]
    assert row["model"] == "sim" and row["oldest_queued_s"] > 0.5 and 240 <= row["batch_ms"] <= 400
    need = row["arrival_rate_per_s"] * row["batch_ms"] / 1000 / 50 * 1.25  # rate x batch time / size x headroom
    assert row["recommended_workers"] == max(1, math.ceil(need))


def test_a_tenant_over_its_cap_gets_429_and_others_are_unaffected(keyed: Stack) -> None:
    keyed.admin("tenants", "set", "small", "--max-in-flight", "5")
    small, other = new_key(keyed, "small"), new_key(keyed, "other")
    with ThreadPoolExecutor(max_workers=30) as pool:
        flood = [pool.submit(post, keyed.url, {"input": f"small {i}"}, headers=auth(small)) for i in range(20)]
        # the other tenant sends once "small" is at its cap (a flood request refused: 5 others are in flight)
        wait_for(lambda: any(f.done() and not f.exception() and f.result().status_code == 429 for f in flood)
                 or all(f.done() for f in flood), 30, "a request of the flood refused")
        calm = [pool.submit(post, keyed.url, {"input": f"other {i}"}, headers=auth(other)) for i in range(10)]
        flood_r = [f.result() for f in flood]
        calm_r = [f.result() for f in calm]
    refused = [r for r in flood_r if r.status_code == 429]
    served = [r for r in flood_r if r.status_code == 200]
    assert refused and len(served) >= 5 and len(served) + len(refused) == 20
    error = assert_json_error(refused[0], 429, "tenant_over_limit")
    assert "small" in error["message"] and int(refused[0].headers["Retry-After"]) >= 1
    assert [r.status_code for r in calm_r] == [200] * 10


def load(stack: Stack, key: str, rate: float, duration: float, timeout_ms: int, seed: int,
         priority: str | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "bench.load", "--url", stack.url, "--rate", str(rate),
            "--duration", str(duration), "--timeout-ms", str(timeout_ms), "--seed", str(seed), "--key", key,
            "--out", str(stack.tmp / f"load-{seed}.json")]
    return subprocess.Popen(argv + (["--priority", priority] if priority else []), cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL)


def records(stack: Stack, proc: subprocess.Popen[str], seed: int) -> list[dict[str, object]]:
    assert proc.wait(timeout=180) == 0
    return json.loads((stack.tmp / f"load-{seed}.json").read_text())["records"]


def test_a_flood_from_one_tenant_does_not_hold_up_another(keyed: Stack) -> None:
    """A sends 5,000 requests at 1.5x the device's capacity (a backlog of seconds, draining 25 s after it
    starts); B's steady stream, sent once alone and once into the thick of A's backlog, stays near solo."""
    keyed.admin("tenants", "set", "flood-a", "--max-in-flight", "10000")
    a, b = new_key(keyed, "flood-a"), new_key(keyed, "steady-b")
    solo = records(keyed, load(keyed, b, rate=8, duration=4, timeout_ms=30_000, seed=10), 10)
    solo_p50 = percentile([float(r["ms"]) for r in solo], 50)  # type: ignore[arg-type]

    flood = load(keyed, a, rate=1.5 * CAPACITY, duration=5000 / (1.5 * CAPACITY), timeout_ms=120_000, seed=11)
    # A's backlog is 800 items (4 s of device time) and growing: FIFO would make B wait that
    wait_for(lambda: keyed.tenant_inflight("flood-a") >= 4 * CAPACITY, 60, "A's backlog of 4 s of device time")
    steady = load(keyed, b, rate=8, duration=8, timeout_ms=30_000, seed=12)
    b_records = records(keyed, steady, 12)
    b_done = max(float(r["wall"]) + float(r["ms"]) / 1000 for r in b_records)  # type: ignore[arg-type]
    a_records = records(keyed, flood, 11)

    # every call of A's flood answered: 200, or the door's 429 "overloaded" when its API process ran more than
    # LLMB_DOOR_MAX_DELAY_MS behind (0-246 of 5,038 in eight runs beside a busy-loop process; it is what the door
    # does for a starved process): a told refusal, never a 5xx, a 504 or a lost call
    refused = [r for r in a_records if r["status"] != 200]
    assert all(r["status"] == 429 and r.get("error") == "overloaded" for r in refused), refused[:5]
    assert len(a_records) - len(refused) >= 4500, "A's flood is answered"
    a_finish = [float(r["wall"]) + float(r["ms"]) / 1000 for r in a_records]  # type: ignore[arg-type]
    assert max(a_finish) > b_done + 2.0, "A's backlog outlived B's stream (so B really competed with it)"
    assert all(r["status"] == 200 for r in b_records)
    b_ms = [float(r["ms"]) for r in b_records]  # type: ignore[arg-type]
    b_p50, b_p99 = percentile(b_ms, 50), percentile(b_ms, 99)
    assert solo_p50 is not None and b_p50 is not None and b_p99 is not None  # B was answered, alone and beside A
    # Served in the next batch or two, not behind A's backlog (4-8 s deep while B sends).
    assert b_p50 < solo_p50 + 3 * BATCH_MS + 500, (solo_p50, b_p50)
    assert b_p99 < 3000, (solo_p50, b_p99)


def test_interactive_requests_go_ahead_of_offline_ones(keyed: Stack) -> None:
    key = new_key(keyed, "mixed")
    offline = load(keyed, key, rate=2 * CAPACITY, duration=3, timeout_ms=120_000, seed=21, priority="offline")
    # an offline backlog of 2 s of device time: behind it, FIFO would keep "urgent" past its bound below
    wait_for(lambda: keyed.tenant_inflight("mixed") >= 2 * CAPACITY, 30, "an offline backlog of 2 s of device time")
    started = time.monotonic()
    r = post(keyed.url, {"input": "urgent"}, headers=auth(key))
    urgent_ms = (time.monotonic() - started) * 1000
    assert r.status_code == 200 and r.json()["output"] == expected("urgent")
    offline_p50 = percentile([float(x["ms"]) for x in records(keyed, offline, 21)], 50)  # type: ignore[arg-type]
    assert urgent_ms < 4 * BATCH_MS + 500, urgent_ms
    assert offline_p50 is not None and urgent_ms < offline_p50, (urgent_ms, offline_p50)
    assert_json_error(post(keyed.url, {"input": "x", "priority": "urgent"}, headers=auth(key)), 400)
    long = post(keyed.url, {"input": "long deadline", "priority": "offline", "timeout_ms": 1_000_000},
                headers=auth(key))
    assert long.status_code == 200, long.text
    assert_json_error(post(keyed.url, {"input": "x", "timeout_ms": 1_000_000}, headers=auth(key)), 400)


def test_openai_clients_authenticate_with_their_api_key(keyed: Stack) -> None:
    import openai

    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=new_key(keyed, "openai-team"), max_retries=0)
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="llmb_00000000_" + "y" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model="sim", input="x")
    with pytest.raises(openai.BadRequestError, match="cannot serve"):  # past the key: sim is no embedding model
        good.embeddings.create(model="sim", input="x")
