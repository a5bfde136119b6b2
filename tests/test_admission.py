"""The deadline-aware admission cap, as a pure function."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from harness.admitting import collect, try_admit
from harness.stack import REDIS_URL, wait_for
from tasks.config import Settings
from tasks.policy.capacity import deadline_cap, full_batches_margin, left_after, recommended_workers, retry_after_s
from tasks.schema import Priority, WorkerInfo
from tasks.state.admission import Admission, AdmissionVerdict, AdmitCall, CollectCall, Ticket
from tasks.state.model_load import model_load


def redis_now(client: redis.Redis) -> float:
    """Redis's clock, the one the admission scripts go by."""
    seconds, micros = client.time()
    return float(seconds) + micros / 1_000_000


def test_the_admission_cap_shrinks_to_what_the_fleet_can_answer_in_time() -> None:
    def w(batch_ms: float) -> WorkerInfo:
        return WorkerInfo(id="w", queue="q", model="sim", max_batch=100, state="idle", outstanding=0, completed=0,
                          batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)

    assert deadline_cap([], 5.0, 10_000, 0.75) == 10_000  # nothing measured yet: the configured cap
    assert deadline_cap([w(0.0)], 5.0, 10_000, 0.75) == 10_000
    # a batch per worker, and 3/4 of the rest of what 400 items/s answer in 5 s less two batches
    assert deadline_cap([w(250.0)], 5.0, 10_000, 0.75) == 100 + (1800 - 100) * 3 // 4
    assert deadline_cap([w(250.0)], 5.0, 10_000, 1.0) == 1800  # all of it, at LLMB_QUEUE_SHARE=1
    # (400 + 200)/s, slow batches
    assert deadline_cap([w(250.0), w(500.0)], 2.0, 10_000, 0.75) == 200 + (600 - 200) * 3 // 4
    assert deadline_cap([w(250.0)], 0.1, 10_000, 0.75) == 100  # never below one full batch per worker
    assert deadline_cap([w(250.0)], 300.0, 10_000, 0.75) == 10_000  # never above the configured cap
    # one batch time less of margin once the batches running are known to be full: 400/s x (5 s - 0.25 s)
    assert deadline_cap([w(250.0)], 5.0, 10_000, 1.0, margin_batches=1) == 1900
    with pytest.raises(ValueError, match=r"LLMB_QUEUE_SHARE=1\.5 is not between 0\.1 and 1"):
        Settings.of(queue_share=1.5)


def test_one_batch_time_of_margin_once_a_deep_line_has_run_only_full_batches() -> None:
    """A line deeper than the workers take (their outstanding batches, and a full batch each waiting) for as long
    as a batch can wait and run: every batch running was formed full, so the batch running when a call's turn
    comes needs no second batch time of margin. Two until then (a burst's first batches: 1 and 16 items)."""
    def w(batch_ms: float) -> WorkerInfo:
        return WorkerInfo(id="w", queue="q", model="sim", max_batch=100, state="busy", outstanding=2, completed=9,
                          batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)

    assert full_batches_margin([w(250.0)], 0.0, 2) == 2.0  # not deep, or only just
    assert full_batches_margin([w(250.0)], 0.49, 2) == 2.0  # a batch formed before it may still be running
    assert full_batches_margin([w(250.0)], 0.5, 2) == 1.0  # two batch times: formed (at most one ahead) and run
    assert full_batches_margin([w(250.0)], 0.6, 3) == 2.0  # a worker taking three waits longer for its third
    assert full_batches_margin([w(250.0)], 0.75, 3) == 1.0
    assert full_batches_margin([w(250.0), w(500.0)], 0.9, 2) == 2.0  # by the slowest worker's batch
    assert full_batches_margin([w(250.0), w(500.0)], 1.0, 2) == 1.0
    assert full_batches_margin([], 100.0, 2) == 2.0  # no worker known


def test_recommended_workers_follow_arrival_rate_batch_time_and_headroom() -> None:

    def w(batch_ms: float) -> WorkerInfo:
        return WorkerInfo(id="w", queue="q", model="sim", max_batch=100, state="idle", outstanding=0, completed=0,
                          batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)

    assert recommended_workers(100.0, [w(0.0)], 1.25) is None  # no batch measured yet: no basis
    assert recommended_workers(0.0, [w(250.0)], 1.25) == 0  # nothing arrives
    assert recommended_workers(1.0, [w(250.0)], 1.25) == 1  # anything arriving needs one
    assert recommended_workers(400.0, [w(250.0)], 1.0) == 1  # exactly one device's capacity
    assert recommended_workers(400.0, [w(250.0)], 1.25) == 2  # ... plus headroom
    assert recommended_workers(1000.0, [w(250.0), w(250.0)], 1.25) == 4  # 1000/s x 0.25 s / 100 x 1.25


def test_retry_after_is_the_time_the_work_ahead_takes_to_drain() -> None:
    def w(batch_ms: float) -> WorkerInfo:
        return WorkerInfo(id="w", queue="q", model="sim", max_batch=100, state="idle", outstanding=0, completed=0,
                          batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)

    assert retry_after_s(1800, []) == 1  # nothing measured: the floor
    assert retry_after_s(1800, [w(250.0)]) == 5  # 1,800 ahead at 400/s: 4.5 s, rounded up
    assert retry_after_s(1800, [w(250.0), w(250.0)]) == 3  # twice the devices, half the wait
    assert retry_after_s(10, [w(250.0)], floor_s=2) == 2  # never below the configured floor
    assert retry_after_s(10**6, [w(250.0)]) == 60  # nor above a minute


def test_a_line_is_shorter_by_what_the_fleet_answers_before_a_turn_comes() -> None:
    def w(batch_ms: float) -> WorkerInfo:
        return WorkerInfo(id="w", queue="q", model="sim", max_batch=100, state="idle", outstanding=0, completed=0,
                          batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)

    assert left_after(1000, [w(250.0)], 0.0) == 1000  # a turn now: nothing answered yet
    assert left_after(1000, [w(250.0)], 0.5) == 1000  # within two batch times: nothing counted as answered
    assert left_after(1000, [w(250.0)], 1.5) == 600  # then 400 a second
    assert left_after(1000, [w(250.0), w(250.0)], 1.5) == 200  # two workers, twice that
    assert left_after(1000, [w(250.0), w(500.0)], 2.0) == 1000 - 600 * 1.0  # (400 + 200)/s after two slow batches
    assert left_after(1000, [w(250.0)], 10.0) == 0  # never below nothing
    assert left_after(1000, [], 10.0) == 1000  # no worker known: nothing drains
    assert left_after(1000, [w(0.0)], 10.0) == 1000  # nor before any batch is measured


def test_each_verdict_says_how_much_the_model_holds() -> None:
    """A refusal for room says how much is ahead (the Retry-After); an admission, how much the model holds with
    the call in (the next call's place: the API process's view of the line, tasks.policy.room)."""
    client = redis.Redis.from_url(REDIS_URL)
    ns = f"adm{uuid.uuid4().hex[:8]}"
    adm = Admission(client, f"{ns}:inflight", 1000, f"{ns}:quarantine", instance="api-1")

    def admit(n: int, ticket: Ticket, *, model_cap: int, tenant_cap: int) -> tuple[AdmissionVerdict, int]:
        ids = [uuid.uuid4().hex for _ in range(n)]
        decision = try_admit(adm, ids, ["h"] * n, ticket=ticket, now=time.time(), timeout_s=30, model_cap=model_cap,
                             tenant_cap=tenant_cap)
        return decision.verdict, decision.ahead

    try:
        assert admit(7, Ticket("a", "sim"), model_cap=10, tenant_cap=100) == (AdmissionVerdict.OK, 7)
        # the model's set
        assert admit(4, Ticket("b", "sim"), model_cap=10, tenant_cap=100) == (AdmissionVerdict.FULL, 7)
        assert admit(2, Ticket("b", "sim"), model_cap=10, tenant_cap=100) == (AdmissionVerdict.OK, 9)
        # the tenant's
        assert admit(1, Ticket("a", "sim"), model_cap=100, tenant_cap=7) == (AdmissionVerdict.TENANT_FULL, 7)
        assert admit(1, Ticket("c", "sim", Priority.OFFLINE), model_cap=100, tenant_cap=7) == (AdmissionVerdict.OK, 10)
    finally:
        for key in client.scan_iter(f"{ns}:*"):
            client.delete(key)


def test_admission_caps_against_the_real_redis() -> None:
    """The Lua script: tenant cap, model cap per priority, release from every set, purge of expired items."""
    import time
    import uuid

    import redis

    from harness.stack import REDIS_URL
    from tasks.state.admission import Admission, AdmissionVerdict, Ticket

    client = redis.Redis.from_url(REDIS_URL)
    ns = f"adm{uuid.uuid4().hex[:8]}"
    adm = Admission(client, f"{ns}:inflight", 1000, f"{ns}:quarantine", instance="api-1")
    now = time.time()
    chat, job = Ticket("chat", "sim"), Ticket("batch-job", "sim", Priority.OFFLINE)

    def admit(ticket: Ticket, n: int, *, model_cap: int = 10, tenant_cap: int = 100, timeout_s: float = 30
              ) -> tuple[AdmissionVerdict, list[str]]:
        ids = [uuid.uuid4().hex for _ in range(n)]
        verdict, *_ = try_admit(adm, ids, ["h"] * n, ticket=ticket, now=time.time(), timeout_s=timeout_s,
                                model_cap=model_cap, tenant_cap=tenant_cap)
        return verdict, ids

    try:
        assert admit(job, 10)[0] is AdmissionVerdict.OK  # offline work fills the model's room...
        assert admit(job, 1)[0] is AdmissionVerdict.FULL  # ...for more offline work
        verdict, chat_ids = admit(chat, 8)
        assert verdict is AdmissionVerdict.OK  # interactive callers count only interactive work ahead of them
        assert admit(chat, 3)[0] is AdmissionVerdict.FULL
        assert admit(Ticket("small", "sim"), 3, tenant_cap=2)[0] is AdmissionVerdict.TENANT_FULL
        assert adm.tenant_in_flight("chat", now) == 8 and adm.in_flight(now) == 18
        oldest = model_load(adm, ["sim"], now + 2)["sim"]
        assert 1.9 < oldest.oldest_age_s < 2.1 and oldest.rate_per_s > 0  # interactive arrivals only
        adm.release(chat, chat_ids)
        assert adm.tenant_in_flight("chat", now) == 0 and adm.in_flight(now) == 10
        assert model_load(adm, ["sim"], now)["sim"].oldest_age_s == 0.0
        assert admit(chat, 10)[0] is AdmissionVerdict.OK
        # an API process that died leaks nothing past its callers' deadlines (Redis's clock decides)
        verdict, gone = admit(Ticket("gone", "sim"), 5, model_cap=100, timeout_s=0.2)
        assert verdict is AdmissionVerdict.OK
        assert adm.tenant_in_flight("gone", time.time()) == 5
        deadline = max(float(client.zscore(adm.tenant_key("gone"), i) or 0) for i in gone)  # Redis's time + 0.2 s
        assert deadline > 0
        wait_for(lambda: redis_now(client) > deadline, 10, "Redis's clock to pass their deadline")
        assert admit(Ticket("gone", "sim"), 5, model_cap=100, tenant_cap=5)[0] is AdmissionVerdict.OK
        # an API host whose clock runs an hour fast purges nobody else's live admissions
        ids = [uuid.uuid4().hex for _ in range(3)]
        assert try_admit(adm, ids, ["h"] * 3, ticket=Ticket("skewed", "sim"), now=time.time() + 3600, timeout_s=30,
                         model_cap=1000, tenant_cap=100)[0] is AdmissionVerdict.OK
        assert adm.tenant_in_flight("chat", time.time()) == 10
    finally:
        for key in client.scan_iter(f"{ns}:*"):
            client.delete(key)


@pytest.fixture
def ns() -> Iterator[tuple[redis.Redis, str]]:
    """The real Redis and a key prefix of this test's own, removed afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"adm{uuid.uuid4().hex[:8]}"
    yield client, prefix
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def test_offline_items_have_their_own_global_cap(ns: tuple[redis.Redis, str]) -> None:
    client, prefix = ns
    adm = Admission(client, f"{prefix}:inflight", 10, f"{prefix}:quarantine", offline_cap=50, instance="api-1")

    def admit(ticket: Ticket, n: int) -> AdmissionVerdict:
        ids = [uuid.uuid4().hex for _ in range(n)]
        return try_admit(adm, ids, ["h"] * n, ticket=ticket, now=time.time(), timeout_s=30, model_cap=1000,
                         tenant_cap=1000)[0]

    assert admit(Ticket("job", "sim", Priority.OFFLINE), 50) is AdmissionVerdict.OK
    assert admit(Ticket("job", "sim", Priority.OFFLINE), 1) is AdmissionVerdict.FULL
    assert admit(Ticket("chat", "sim"), 10) is AdmissionVerdict.OK  # the offline backlog leaves interactive room alone
    assert admit(Ticket("chat", "sim"), 1) is AdmissionVerdict.FULL


def test_a_dead_api_process_releases_what_it_admitted_when_its_lease_lapses(ns: tuple[redis.Redis, str]) -> None:
    """A process that died holds nothing past its lease, even for callers with an hour-long deadline."""
    client, prefix = ns
    dead = Admission(client, f"{prefix}:inflight", 100, f"{prefix}:quarantine", instance="dead", lease_s=0.2)
    alive = Admission(client, f"{prefix}:inflight", 100, f"{prefix}:quarantine", instance="alive", lease_s=5)
    for ticket in (Ticket("t", "sim"), Ticket("job", "sim", Priority.OFFLINE)):
        ids = [uuid.uuid4().hex for _ in range(5)]
        assert try_admit(dead, ids, ["h"] * 5, ticket=ticket, now=time.time(), timeout_s=3600,
                         model_cap=100)[0] is AdmissionVerdict.OK
    assert alive.renew() == 0 and dead.in_flight(time.time()) == 10
    lease_ends = client.zscore(dead.leases_key, "dead")
    assert lease_ends is not None
    wait_for(lambda: redis_now(client) > lease_ends, 10, "Redis's clock to pass the dead process's lease")
    assert alive.renew() == 10
    assert alive.in_flight(time.time()) == 0 and alive.tenant_in_flight("t", time.time()) == 0
    assert not [k for k in client.scan_iter(f"{prefix}:*") if client.type(k) == b"zset" and client.zcard(k)
                and not k.endswith(b":instances")]
    assert not client.exists(f"{prefix}:inflight:owner:dead")


def test_with_no_api_process_left_a_reaper_without_a_lease_releases_what_a_lapsed_one_admitted(
        ns: tuple[redis.Redis, str]) -> None:
    """The only API host cut off: nobody renews a lease, so the batcher reaps (holding no lease of its own)."""
    client, prefix = ns
    cut = Admission(client, f"{prefix}:inflight", 100, f"{prefix}:quarantine", instance="cut", lease_s=0.2)
    reaper = Admission(client, f"{prefix}:inflight", 100, f"{prefix}:quarantine")
    ids = [uuid.uuid4().hex for _ in range(7)]
    assert try_admit(cut, ids, ["h"] * 7, ticket=Ticket("t", "sim"), now=time.time(), timeout_s=3600,
                     model_cap=100)[0] is AdmissionVerdict.OK
    assert cut.renew() == 0 and reaper.reap() == 0
    lease_ends = client.zscore(cut.leases_key, "cut")
    assert lease_ends is not None
    wait_for(lambda: redis_now(client) > lease_ends, 10, "Redis's clock to pass the cut process's lease")
    assert reaper.reap() == 7
    assert reaper.in_flight(time.time()) == 0
    assert client.zcard(cut.leases_key) == 0, "the reaper holds no lease and the lapsed one is gone"


def test_a_call_that_reaches_redis_after_its_caller_gave_up_is_not_admitted(ns: tuple[redis.Redis, str]) -> None:
    """A link that came back delivers an admission sent seconds ago; its caller already got 503, so it must not
    take capacity (nobody would release it)."""
    client, prefix = ns
    adm = Admission(client, f"{prefix}:inflight", 100, f"{prefix}:quarantine", instance="api", lease_s=5)
    ids = [uuid.uuid4().hex for _ in range(3)]
    late = try_admit(adm, ids, ["h"] * 3, ticket=Ticket("t", "sim"), now=time.time(), timeout_s=30, model_cap=100,
                     valid_until=redis_now(client) - 0.5)
    assert late.verdict is AdmissionVerdict.LATE
    assert adm.in_flight(time.time()) == 0 and not client.hlen(adm.owner_key)
    in_time = try_admit(adm, ids, ["h"] * 3, ticket=Ticket("t", "sim"), now=time.time(), timeout_s=30,
                        model_cap=100, valid_until=redis_now(client) + 2.5)
    assert in_time.verdict is AdmissionVerdict.OK and adm.in_flight(time.time()) == 3


def test_a_models_token_budget_counts_prompt_and_max_tokens_and_every_release_path_gives_them_back(
        ns: tuple[redis.Redis, str]) -> None:
    """Generation items are admitted while the model's admitted tokens fit its budget (the fleet's KV room);
    answered, released, expired or reaped, their tokens come back."""
    client, prefix = ns
    adm = Admission(client, f"{prefix}:inflight", 1000, f"{prefix}:quarantine", instance="api", lease_s=0.3)
    lm = Ticket("t", "lm")

    def admit(tokens: list[int], timeout_s: float = 30) -> tuple[list[str], AdmissionVerdict]:
        ids = [uuid.uuid4().hex for _ in tokens]
        decision = try_admit(adm, ids, ["h"] * len(ids), ticket=lm, now=time.time(), timeout_s=timeout_s,
                             model_cap=1000, tokens=tokens, token_cap=10_000)
        return ids, decision.verdict

    first, verdict = admit([3000, 3000])
    assert verdict is AdmissionVerdict.OK and adm.tokens_held("lm") == 6000
    _, verdict = admit([5000])
    assert verdict is AdmissionVerdict.TOKENS_FULL and adm.tokens_held("lm") == 6000  # refused whole
    second, verdict = admit([4000])
    assert verdict is AdmissionVerdict.OK and adm.tokens_held("lm") == 10_000

    client.set(f"{prefix}:r:{first[0]}", "done")
    collect(adm, lm, first, [f"{prefix}:r:{first[0]}", f"{prefix}:r:{first[1]}"])  # one answered
    assert adm.tokens_held("lm") == 7000
    adm.release(lm, [first[1]])
    assert adm.tokens_held("lm") == 4000

    _short, verdict = admit([500], timeout_s=0.2)
    assert verdict is AdmissionVerdict.OK and adm.tokens_held("lm") == 4500
    wait_for(lambda: admit([0])[1] is AdmissionVerdict.OK and adm.tokens_held("lm") == 4000, 10,
             "the expired item's tokens to be purged at the next admission")

    reaper = Admission(client, f"{prefix}:inflight", 1000, f"{prefix}:quarantine")
    lease_ends = client.zscore(adm.leases_key, "api")
    assert lease_ends is not None
    wait_for(lambda: redis_now(client) > lease_ends, 10, "the lease to lapse")
    assert reaper.reap() >= 1
    assert adm.tokens_held("lm") == 0 and not client.hlen(f"{prefix}:inflight:m:lm:kv")
    assert second  # (its tokens went with the reaped lease)


def test_one_round_admits_several_calls_in_order_each_with_its_own_verdict(ns: tuple[redis.Redis, str]) -> None:
    """The door's round (one script call for the calls an API process has ready): a call admitted counts against
    the caps of the calls after it, a quarantined input refuses its own call only, and every call's record is
    written only if it was admitted."""
    client, prefix = ns
    adm = Admission(client, f"{prefix}:inflight", 100, f"{prefix}:quarantine", instance="api", lease_s=5)
    client.sadd(f"{prefix}:quarantine", "bad")

    def call(tenant: str, n: int, hashes: list[str] | None = None) -> AdmitCall:
        return AdmitCall(tuple(uuid.uuid4().hex for _ in range(n)), tuple(hashes or ["h"] * n), Ticket(tenant, "sim"),
                         time.time(), 30, model_cap=10, tenant_cap=100,
                         record=(f"{prefix}:rec:{tenant}:{n}", f"record of {tenant}", 60))

    calls = [call("a", 6), call("b", 1, ["bad"]), call("c", 5), call("d", 4)]
    decisions = adm.try_admit_many(calls, valid_until=redis_now(client) + 2.5)
    assert [d.verdict for d in decisions] == [AdmissionVerdict.OK, AdmissionVerdict.QUARANTINED,
                                              AdmissionVerdict.FULL, AdmissionVerdict.OK]
    assert decisions[1].bad_hash == "bad" and decisions[2].ahead == 6  # c saw a's 6 items ahead of it
    assert adm.in_flight(time.time()) == 10
    assert [client.get(c.record[0]) for c in calls if c.record] == [b"record of a", None, None, b"record of d"]

    # the results of two calls read (and released) in one round trip: one finished, one with a result to come
    keys = {i: f"{prefix}:result:{i}" for c in calls for i in c.item_ids}
    a, d = calls[0], calls[3]
    for i in a.item_ids + d.item_ids[:2]:
        client.set(keys[i], '{"output": "x"}', ex=60)
    reads = adm.collect_many([
        CollectCall(a.ticket, a.item_ids, tuple(keys[i] for i in a.item_ids), (f"{prefix}:rec:a:6", "a finished")),
        CollectCall(d.ticket, d.item_ids, tuple(keys[i] for i in d.item_ids), (f"{prefix}:rec:d:4", "d finished")),
    ])
    assert [(len([v for v in values if v]), done) for values, done in reads] == [(6, True), (2, False)]
    assert client.get(f"{prefix}:rec:a:6") == b"a finished" and client.get(f"{prefix}:rec:d:4") == b"record of d"
    assert adm.in_flight(time.time()) == 2  # d's two items without a result
