"""Idempotency-Key and GET /v1/requests/<id>, end to end, with API keys on.

Real gunicorn (2 processes), batcher, a sim worker (800 ms batches: a call is still running when its retry comes)
and a sim-lm worker for the OpenAI routes, driven with requests and the official `openai` client. "Ran once" is
read from the workers' own items-done counter in Redis, once nothing is left in flight.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.helpers import assert_json_error, decoded, expected, post
from harness.stack import Stack, wait_for

openai = pytest.importorskip("openai", reason="bin/test installs the 'models' extra (with openai) these tests need")

BATCH_MS = 800
LM = "sim-lm"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(Path(tmp_path_factory.mktemp("idempotency")), auth="keys", auth_cache_s=0.5, sim_batch_ms=BATCH_MS,
              api_lease_s=2, sim_lm_eos_mean=0)
    try:
        s.start_worker(0)
        s.start_worker(1, backend="sim-lm")
        s.start_batcher()
        s.start_web(workers=2)
        s.wait_ready(workers=2)
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def keys(keyed: Stack) -> dict[str, str]:
    """An API key per tenant, issued with the real `llmb-admin`."""
    return {tenant: keyed.admin("keys", "create", tenant).stdout.strip() for tenant in ("team-a", "team-b")}


def headers(key: str, idem: str | None = None, **extra: str) -> dict[str, str]:
    h = {"Authorization": f"Bearer {key}", **extra}
    if idem is not None:
        h["Idempotency-Key"] = idem
    return h


def ran(stack: Stack, before: int) -> int:
    """Items the workers answered since ``before``, once nothing admitted is left unanswered (a second run, had
    there been one, would still hold its admission until answered)."""
    wait_for(lambda: stack.inflight() == 0, 30, "nothing left in flight")
    return stack.items_done() - before


def batch_started(stack: Stack) -> Callable[[], bool]:
    """A condition: a worker runs a batch that started after this call (it holds the batch's claim, its run id,
    until the results are written)."""
    claims = f"{stack.namespace}:claim:*"
    old = set(stack.redis.scan_iter(claims, count=1000))

    def running() -> bool:
        fresh = [k for k in stack.redis.scan_iter(claims, count=1000) if k not in old]
        return any(not decoded(stack.redis.get(k) or b"~").startswith("~") for k in fresh)

    return running


def idem_key(stack: Stack, tenant: str, key: str) -> str:
    """The Redis key of a tenant's Idempotency-Key (tasks.state.keys names it)."""
    return f"{stack.namespace}:idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"


def test_the_same_key_twice_runs_once_and_answers_the_same(keyed: Stack, keys: dict[str, str]) -> None:
    before, key = keyed.items_done(), uuid.uuid4().hex
    first = post(keyed.url, {"input": "once"}, headers=headers(keys["team-a"], key))
    again = post(keyed.url, {"input": "once"}, headers=headers(keys["team-a"], key, **{"X-Request-Id": "other"}))
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["output"] == expected("once")
    assert again.json() == first.json()  # the same body, timing included
    assert again.headers["X-Request-Id"] == first.headers["X-Request-Id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    # the key is the same request however its JSON is laid out
    spaced = post(keyed.url, data='{ "input" : "once" }', headers={**headers(keys["team-a"], key),
                                                                   "Content-Type": "application/json"})
    assert spaced.json() == first.json()
    assert ran(keyed, before) == 1
    assert_json_error(post(keyed.url, {"input": "once"}, headers=headers(keys["team-a"], "bad\tkey")), 400,
                      "invalid_request")


def test_concurrent_duplicates_run_once(keyed: Stack, keys: dict[str, str]) -> None:
    """Eight at once, landing on both gunicorn processes: one claims the key, the others follow it."""
    before, key = keyed.items_done(), uuid.uuid4().hex
    body = {"inputs": ["dup 1", "dup 2", "dup 3"]}
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda _: post(keyed.url, body, headers=headers(keys["team-a"], key)), range(8)))
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert all(r.json() == answers[0].json() for r in answers)
    assert answers[0].json()["outputs"] == [expected(t) for t in body["inputs"]]
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in answers) == 7
    assert ran(keyed, before) == 3


def test_a_different_body_with_the_same_key_is_409_and_tenants_do_not_share_keys(keyed: Stack,
                                                                                   keys: dict[str, str]) -> None:
    before, key = keyed.items_done(), uuid.uuid4().hex
    a = post(keyed.url, {"input": "mine"}, headers=headers(keys["team-a"], key))
    assert a.status_code == 200, a.text
    error = assert_json_error(post(keyed.url, {"input": "not mine"}, headers=headers(keys["team-a"], key)), 409,
                              "idempotency_conflict")
    assert "different request" in error["message"]
    # another tenant's same key (and body) is its own request: run again, under its own id
    b = post(keyed.url, {"input": "mine"}, headers=headers(keys["team-b"], key))
    assert b.status_code == 200 and b.json()["output"] == expected("mine")
    assert b.json()["id"] != a.json()["id"] and "Idempotent-Replayed" not in b.headers
    assert ran(keyed, before) == 2


def test_a_call_refused_before_it_ran_releases_its_key(keyed: Stack) -> None:
    keyed.admin("tenants", "set", "tiny", "--max-in-flight", "1")
    tiny, key = keyed.admin("keys", "create", "tiny").stdout.strip(), uuid.uuid4().hex
    body = {"inputs": ["a", "b"]}  # two items, over its cap of one: 429 before anything is published
    assert_json_error(post(keyed.url, body, headers=headers(tiny, key)), 429, "tenant_over_limit")
    assert not keyed.redis.exists(idem_key(keyed, "tiny", key))
    keyed.admin("tenants", "set", "tiny", "--max-in-flight", "10")
    before = keyed.items_done()
    wait_for(lambda: post(keyed.url, body, headers=headers(tiny, key)).status_code == 200, 15,
             "the retry with the same key to run once the cap allows it (policy cache 0.5 s)")
    assert ran(keyed, before) == 2


def test_a_call_that_missed_its_deadline_after_it_was_published_gets_its_504_again(keyed: Stack,
                                                                                      keys: dict[str, str]) -> None:
    a, key, rid = keys["team-a"], uuid.uuid4().hex, f"late-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = batch_started(keyed)
        blocker = pool.submit(post, keyed.url, {"input": "blocker"}, headers=headers(a))
        wait_for(started, 10, "the blocker's batch to start")
        # behind an 800 ms batch, a 1 s deadline cannot be met by another 800 ms batch: dropped, 504
        late = post(keyed.url, {"input": "late", "timeout_ms": 1000}, headers=headers(a, key, **{"X-Request-Id": rid}))
        assert blocker.result().status_code == 200
    first = assert_json_error(late, 504, "deadline_exceeded")
    again = post(keyed.url, {"input": "late", "timeout_ms": 1000}, headers=headers(a, key))
    assert assert_json_error(again, 504, "deadline_exceeded") == first  # the same error, under the same id
    assert again.headers["Idempotent-Replayed"] == "true"
    got = requests.get(f"{keyed.url}/v1/requests/{rid}", headers=headers(a), timeout=10).json()
    assert got["status"] == "failed" and got["response"] == {"status_code": 504, "body": late.json()}


def test_openai_routes_with_extra_headers(keyed: Stack, keys: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=keys["team-a"], max_retries=0, timeout=60)
    before, key = keyed.items_done(), uuid.uuid4().hex
    args: dict[str, Any] = {"model": LM, "prompt": "Once upon", "max_tokens": 12, "temperature": 0}
    first = client.completions.create(**args, extra_headers={"Idempotency-Key": key})
    again = client.completions.create(**args, extra_headers={"Idempotency-Key": key})
    assert again.model_dump() == first.model_dump() and first.choices[0].text
    with pytest.raises(openai.ConflictError) as conflict:
        client.completions.create(**{**args, "prompt": "Twice upon"}, extra_headers={"Idempotency-Key": key})
    assert conflict.value.code == "idempotency_conflict"
    with pytest.raises(openai.ConflictError):  # the same key on another route is another request
        client.chat.completions.create(model=LM, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_headers={"Idempotency-Key": key})
    chat_key, messages = uuid.uuid4().hex, [{"role": "user", "content": "hello"}]
    c1 = client.chat.completions.create(model=LM, messages=messages, max_tokens=8,
                                        extra_headers={"Idempotency-Key": chat_key})
    c2 = client.chat.completions.create(model=LM, messages=messages, max_tokens=8,
                                        extra_headers={"Idempotency-Key": chat_key})
    assert c2.model_dump() == c1.model_dump()
    assert ran(keyed, before) == 2
    # GET /v1/requests/<id> answers in the route's own shape, the body the call got
    for made, kind in ((first, openai.types.Completion), (c1, openai.types.chat.ChatCompletion)):
        rid = made.id.split("-", 1)[1]
        got = requests.get(f"{keyed.url}/v1/requests/{rid}", headers=headers(keys["team-a"]), timeout=10).json()
        assert got["status"] == "completed" and kind.model_validate(got["response"]["body"]) == made


def test_streams_replay_finished_409_while_running_and_abandoned_ones_run_again(keyed: Stack,
                                                                                 keys: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=keys["team-a"], max_retries=0, timeout=60)
    before, key = keyed.items_done(), uuid.uuid4().hex
    args: dict[str, Any] = {"model": LM, "prompt": "A long tale", "max_tokens": 150, "temperature": 0,
                            "stream": True, "extra_headers": {"Idempotency-Key": key}}
    stream = client.completions.create(**args)  # 150 decoding steps of 11 ms: still running below
    chunks = iter(stream)
    head = next(chunks)
    with pytest.raises(openai.ConflictError) as running:
        client.completions.create(**args)
    assert running.value.code == "idempotency_in_progress"
    text = head.choices[0].text + "".join(c.choices[0].text for c in chunks)
    replay = list(client.completions.create(**args))
    assert "".join(c.choices[0].text for c in replay) == text and text
    assert {c.id for c in replay} == {head.id} and replay[-1].choices[0].finish_reason == "length"
    assert ran(keyed, before) == 1

    # a stream whose caller goes away and does not resume it within LLMB_STREAM_RESUME_MS (10 s by default):
    # finished by then, it ran, and its key answers a retry with it...
    done_key = uuid.uuid4().hex
    left = client.completions.create(**{**args, "extra_headers": {"Idempotency-Key": done_key}})
    next(iter(left))
    left.close()
    wait_for(lambda: keyed.inflight() == 0, 10 + 15, "the left stream's item released once the window passed")
    before = keyed.items_done()
    again = list(client.completions.create(**{**args, "extra_headers": {"Idempotency-Key": done_key}}))
    assert "".join(c.choices[0].text for c in again) == text and ran(keyed, before) == 0
    # ... still running then, it is cancelled and forgotten: the same key runs it again
    gone, long = uuid.uuid4().hex, {**args, "max_tokens": 1000}  # 1000 steps of 11 ms: past the window
    abandoned = client.completions.create(**{**long, "extra_headers": {"Idempotency-Key": gone}})
    next(iter(abandoned))
    abandoned.close()
    wait_for(lambda: not keyed.redis.exists(idem_key(keyed, "team-a", gone)), 10 + 15,
             "the abandoned stream's key to be released")
    fresh = list(client.completions.create(**{**args, "extra_headers": {"Idempotency-Key": gone}}))
    assert "".join(c.choices[0].text for c in fresh) == text  # the same prompt, greedy: the same text


def test_a_replayed_stream_of_several_choices_gives_each_its_whole_text(keyed: Stack, keys: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=keys["team-a"], max_retries=0, timeout=60)
    before = keyed.items_done()
    args: dict[str, Any] = {"model": LM, "prompt": "two tales", "max_tokens": 12, "seed": 4, "n": 2, "stream": True,
                            "stream_options": {"include_usage": True},
                            "extra_headers": {"Idempotency-Key": uuid.uuid4().hex}}

    def texts(chunks: list[Any]) -> dict[int, str]:
        out: dict[int, str] = {}
        for c in chunks:
            for choice in c.choices:
                out[choice.index] = out.get(choice.index, "") + choice.text
        return out

    first = list(client.completions.create(**args))
    replay = list(client.completions.create(**args))
    assert texts(replay) == texts(first) and len(texts(first)) == 2 and all(texts(first).values())
    assert replay[-1].usage == first[-1].usage and first[-1].usage is not None
    assert ran(keyed, before) == 2  # the two choices ran once


def test_get_request_for_its_tenant_only(keyed: Stack, keys: dict[str, str]) -> None:
    a, b = keys["team-a"], keys["team-b"]
    rid = f"get-{uuid.uuid4().hex[:8]}"
    url = f"{keyed.url}/v1/requests/{rid}"
    with ThreadPoolExecutor(max_workers=1) as pool:
        call = pool.submit(post, keyed.url, {"inputs": ["g1", "g2"]}, headers=headers(a, **{"X-Request-Id": rid}))
        seen: list[dict[str, Any]] = []

        def recorded() -> bool:
            r = requests.get(url, headers=headers(a), timeout=10)
            seen.extend([r.json()] if r.status_code == 200 else [])
            return bool(seen)

        wait_for(recorded, 10, "the call to be recorded")
        running = seen[0]
        answered = call.result()
    assert answered.status_code == 200, answered.text
    assert running["status"] == "running" and running["id"] == rid and "response" not in running
    assert running["items"] == 2 and running["route"] == "infer"
    done = requests.get(url, headers=headers(a), timeout=10)
    assert done.status_code == 200 and done.json()["status"] == "completed"
    assert done.json()["response"] == {"status_code": 200, "body": answered.json()}
    # another tenant: 404, exactly as for an id nobody used
    assert_json_error(requests.get(url, headers=headers(b), timeout=10), 404, "not_found")
    assert_json_error(requests.get(f"{keyed.url}/v1/requests/nobody-{rid}", headers=headers(a), timeout=10), 404)
    assert_json_error(requests.get(url, timeout=10), 401)


def test_sigkill_of_the_api_process_holding_the_call_then_a_retry_gets_the_answer(keyed: Stack,
                                                                                   keys: dict[str, str]) -> None:
    """The first call's process dies (SIGKILL) while its batch runs; the worker still writes the result, and a
    retry with the same key on the restarted API gets it: the same output and id, one run."""
    before, key, rid = keyed.items_done(), uuid.uuid4().hex, f"kill-{uuid.uuid4().hex[:8]}"
    running_batch = batch_started(keyed)
    victims = keyed.web_workers()
    with ThreadPoolExecutor(max_workers=1) as pool:
        lost = pool.submit(post, keyed.url, {"input": "survives"},
                           headers=headers(keys["team-a"], key, **{"X-Request-Id": rid}))
        wait_for(running_batch, 10, "the call's batch to start on the worker")
        for pid in victims:  # whichever of gunicorn's processes holds the call
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(requests.ConnectionError):
            lost.result()
    wait_for(lambda: len(keyed.web_workers()) == 2 and not set(keyed.web_workers()) & set(victims), 20,
             "gunicorn to replace its killed processes")
    retry = post(keyed.url, {"input": "survives"}, headers=headers(keys["team-a"], key))
    assert retry.status_code == 200, retry.text
    assert retry.json()["output"] == expected("survives") and retry.json()["id"] == rid
    assert retry.headers["X-Request-Id"] == rid and retry.headers["Idempotent-Replayed"] == "true"
    got = requests.get(f"{keyed.url}/v1/requests/{rid}", headers=headers(keys["team-a"]), timeout=10).json()
    assert got["status"] == "completed" and got["response"]["body"] == retry.json()
    assert ran(keyed, before) == 1



def test_a_claim_whose_process_died_before_publishing_is_taken_over_at_once() -> None:
    """At the Redis level: the claim names a record that was never published and whose process holds no lease.
    A retry claims the key at once (the call never ran); one marked as being sent (its process may have died after
    the publish, before the confirm's mark) or published, or one whose process lives, is waited on."""
    import redis as redis_lib

    from harness.stack import REDIS_URL
    from tasks.state.keys import Keys
    from tasks.state.records import Idempotency, Record
    from tasks.state.requests import Requests

    client = redis_lib.Redis.from_url(REDIS_URL)
    keys = Keys(f"idem-unit-{uuid.uuid4().hex[:8]}")
    leases = keys.inflight + ":instances"
    requests_ = Requests(client, keys, ttl_s=60, leases_key=leases)
    now = float(client.time()[0])

    def record(request_id: str, instance: str) -> Record:
        return Record(request_id=request_id, tenant="t", model="sim", items=(uuid.uuid4().hex,), accepted_at=now,
                      deadline=now + 30, instance=instance, published=False)

    try:
        client.zadd(leases, {"alive": now + 60})
        for instance, mark, taken_over in (("dead", "", True), ("dead", "sending", False),
                                           ("dead", "published", False), ("alive", "", False)):
            idem = Idempotency(f"key-{instance}-{mark}", "body")
            first = replace(record(uuid.uuid4().hex, instance), key_hash=idem.key_hash)
            assert requests_.claim(first, idem, now).claimed
            if mark:
                assert requests_.published([first], sending=mark == "sending") == [True]
            assert requests_.peek("t", idem).claimed is taken_over
            retry = requests_.claim(replace(record(uuid.uuid4().hex, "retrier"), key_hash=idem.key_hash), idem, now)
            assert retry.claimed is taken_over, (instance, mark)
            if not taken_over:
                assert retry.view is not None and retry.view.record.request_id == first.request_id
            else:  # the first call's process comes back: its mark finds the key taken over, so it does not publish
                assert requests_.published([first], sending=True) == [False]
    finally:
        client.delete(*client.keys(f"{keys.namespace}:*") or ["none"])


# -- a key's promise does not depend on request ids (issue 24, item 6) ------------------------------------------
def test_a_reused_request_id_never_takes_a_keys_call_away(keyed: Stack, keys: dict[str, str]) -> None:
    """As a tracer or a proxy in front of us does: every call of one pooled session carries the same X-Request-Id.
    Call 1 (key order-1), call 2 (key order-2), then a retry of call 1: it gets call 1's answer and does not run
    again; so does a retry of call 2 after a call without a key reused the id too; and another tenant's same key
    and id are its own call. GET /v1/requests/<id> names the latest call with the id."""
    a, b, tag = keys["team-a"], keys["team-b"], uuid.uuid4().hex[:8]
    rid, order1, order2 = f"trace-{tag}", f"order-1-{tag}", f"order-2-{tag}"
    before = keyed.items_done()
    with requests.Session() as session:
        def call(key: str, idem: str | None, text: str) -> requests.Response:
            answer = session.post(f"{keyed.url}/v1/infer", json={"input": text},
                                  headers=headers(key, idem, **{"X-Request-Id": rid}), timeout=30)
            assert answer.status_code == 200, answer.text
            return answer

        first, second = call(a, order1, "order one"), call(a, order2, "order two")
        retry = call(a, order1, "order one")
        assert retry.headers["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert retry.json()["output"] == expected("order one") and second.json()["output"] == expected("order two")
        assert ran(keyed, before) == 2, "the retry of call 1 ran again"

        unkeyed = call(a, None, "no key")  # a call without a key, the same id again
        again = call(a, order2, "order two")
        assert again.headers["Idempotent-Replayed"] == "true" and again.json() == second.json()
        latest = session.get(f"{keyed.url}/v1/requests/{rid}", headers=headers(a), timeout=10).json()
        assert latest["response"]["body"] == unkeyed.json()

        theirs = call(b, order1, "order one")  # another tenant: the same key and id are its own call
        assert "Idempotent-Replayed" not in theirs.headers
        assert call(b, order1, "order one").json() == theirs.json()
        assert call(a, order1, "order one").json() == first.json()
    assert ran(keyed, before) == 4  # order-1, order-2, the call without a key, team-b's order-1


def record_key_of(stack: Stack, tenant: str, key: str) -> str:
    """Where the record of the call a tenant's key names lives, as its claim says (claims written before records
    lived under their key name none: the record is under its request id)."""
    claim = json.loads(stack.redis.get(idem_key(stack, tenant, key)) or b"{}")
    return str(claim.get("record") or f"{stack.namespace}:request:{tenant}:{claim['request_id']}")


def test_a_record_that_cannot_be_read_is_a_clear_409_and_its_call_never_runs_again(keyed: Stack,
                                                                                    keys: dict[str, str]) -> None:
    """A damaged record, or one a newer version wrote in a newer format (a rolling upgrade): GET /v1/requests/<id>
    and every retry of its key get 409 record_unreadable in their route's shape, not a 500 or a 503 that blames
    Redis; the call is not run again, and once the record is readable the retry gets the first answer."""
    a, key, rid = keys["team-a"], uuid.uuid4().hex, f"damaged-{uuid.uuid4().hex[:8]}"
    before = keyed.items_done()
    first = post(keyed.url, {"input": "damaged"}, headers=headers(a, key, **{"X-Request-Id": rid}))
    assert first.status_code == 200, first.text
    at = record_key_of(keyed, "team-a", key)
    original = keyed.redis.get(at)
    assert original is not None
    newer = json.dumps({**json.loads(original), "v": 2, "items": {"moved": "elsewhere"}})
    for damage, says in ((b'{"request_id": "dam', "not JSON"), (newer.encode(), "format 2")):
        keyed.redis.set(at, damage, keepttl=True)
        looked = assert_json_error(requests.get(f"{keyed.url}/v1/requests/{rid}", headers=headers(a), timeout=10),
                                   409, "record_unreadable")
        assert says in looked["message"] and rid in looked["message"]
        retried = assert_json_error(post(keyed.url, {"input": "damaged"}, headers=headers(a, key)), 409,
                                    "record_unreadable")
        assert says in retried["message"] and "new Idempotency-Key" in retried["message"]
    keyed.redis.set(at, original, keepttl=True)
    healed = post(keyed.url, {"input": "damaged"}, headers=headers(a, key))
    assert healed.json() == first.json() and healed.headers["Idempotent-Replayed"] == "true"
    assert ran(keyed, before) == 1

    # a call without a key: its record is under its request id
    plain = f"plain-{uuid.uuid4().hex[:8]}"
    assert post(keyed.url, {"input": "plain"}, headers=headers(a, **{"X-Request-Id": plain})).status_code == 200
    keyed.redis.set(f"{keyed.namespace}:request:team-a:{plain}", b"\xff\xfe garbage", keepttl=True)
    assert_json_error(requests.get(f"{keyed.url}/v1/requests/{plain}", headers=headers(a), timeout=10), 409,
                      "record_unreadable")


def test_an_openai_retry_of_an_unreadable_record_is_a_409_in_openai_shape(keyed: Stack, keys: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=keys["team-a"], max_retries=0, timeout=60)
    key, args = uuid.uuid4().hex, {"model": LM, "prompt": "Once", "max_tokens": 4, "temperature": 0}
    client.completions.create(**args, extra_headers={"Idempotency-Key": key})
    keyed.redis.set(record_key_of(keyed, "team-a", key), b"[1, 2", keepttl=True)
    with pytest.raises(openai.ConflictError) as unreadable:
        client.completions.create(**args, extra_headers={"Idempotency-Key": key})
    assert unreadable.value.code == "record_unreadable" and unreadable.value.body["param"] is None
