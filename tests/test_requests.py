"""tasks.state.requests: the record format (pure), and records and claims in a real Redis (a namespace per test).

The end-to-end scenarios (a pooled session reusing one X-Request-Id, a damaged record behind a retry) are in
tests/test_idempotency.py; here the same rules are checked at the level of the Lua scripts, one key at a time.
"""
from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis

from harness.stack import REDIS_URL
from tasks.errors import RecordUnreadable
from tasks.state.keys import Keys
from tasks.state.records import FormatError, Idempotency, Outcome, Record, Shape
from tasks.state.requests import Requests
from webapp.errors import status_of

NOW = 1_800_000_000.25


def record(request_id: str = "rid", instance: str = "alive", **changes: Any) -> Record:
    made = Record(request_id=request_id, tenant="t", model="sim", items=(uuid.uuid4().hex, uuid.uuid4().hex),
                  accepted_at=NOW, deadline=NOW + 30, instance=instance, shape=Shape("chat", stream=True))
    return replace(made, **changes)


def keyed(made: Record, idem: Idempotency) -> Record:
    return replace(made, key_hash=idem.key_hash, published=False)


# -- the format, without Redis ----------------------------------------------------------------------------------
def test_a_record_round_trips_and_one_without_a_key_reads_as_earlier_versions_wrote_it() -> None:
    done = record(outcome=Outcome("deadline_exceeded", "late", 12.5), published=True, key_hash="ab" * 32)
    assert Record.from_json(done.to_json()) == done
    plain = json.loads(record().to_json())
    assert "key_hash" not in plain and "v" not in plain  # the fields of records before this version, no more
    assert set(plain) == {"request_id", "tenant", "model", "items", "accepted_at", "deadline", "instance", "shape",
                          "outcome", "published"}


def test_fields_a_later_version_adds_are_ignored() -> None:
    d = json.loads(record().to_json())
    assert Record.from_json(json.dumps({**d, "region": "eu", "shape": {**d["shape"], "tools": []}})) == \
        Record.from_json(json.dumps(d))


# An outcome as the version before errors were types wrote it (and read it: its status decided, and was answered)
BEFORE_TYPES = [({"status": 200, "type": "", "message": "", "total_ms": 12.5}, Outcome(total_ms=12.5)),
                ({"status": 429, "type": "tenant_over_limit", "message": "over", "total_ms": 0.0},
                 Outcome("tenant_over_limit", "over")),
                ({"status": 504, "type": "deadline_exceeded", "message": "late", "total_ms": 0.0},
                 Outcome("deadline_exceeded", "late"))]


@pytest.mark.parametrize(("stored", "outcome"), BEFORE_TYPES)
def test_an_outcome_is_read_by_its_type_and_written_with_the_status_earlier_versions_read(
        stored: dict[str, Any], outcome: Outcome) -> None:
    """A rolling upgrade, both ways: a record of the version before reads as the same outcome (by its type), and
    this version's record holds every field that version reads, the status it answered with among them."""
    before = json.dumps({**json.loads(record().to_json()), "outcome": stored})
    assert Record.from_json(before).outcome == outcome
    assert outcome.failed == (stored["status"] != 200)
    assert json.loads(record(outcome=outcome).to_json(status_of))["outcome"] == stored


def test_a_failure_without_a_type_or_a_status_reads_as_what_it_can_mean() -> None:
    """No writer ever stored these; read defensively all the same: a failed status without a type is an internal
    error, a record of a later version that writes no status is read by its type alone."""
    assert Outcome.checked({"status": 500}) == Outcome("internal_error")
    assert Outcome.checked({"type": "queue_full", "message": "full"}) == Outcome("queue_full", "full")
    assert Outcome.checked({"total_ms": 3.0}) == Outcome(total_ms=3.0)


def _with(**changes: Any) -> str:
    return json.dumps({**json.loads(record().to_json()), **changes})


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"request_id": "dam', "not JSON"),
    (b"\xff\xfe", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ("null", "not a JSON object"),
    (_with(v=2), "format 2, newer than"),
    (_with(v="1"), "format '1'"),
    (_with(items=[]), "'items'"),
    (_with(items=["a", 1]), "'items'"),
    (_with(items={"a": 1}), "'items' field is a dict"),
    (_with(accepted_at="yesterday"), "'accepted_at' field is a str"),
    (_with(deadline=True), "'deadline' field is a bool"),
    (_with(deadline=math.inf), "'deadline' field is not a finite number"),
    ('{"deadline": ' + "9" * 400 + "}", "no 'items'"),
    (_with(deadline=10**400), "'deadline' field is not a finite number"),
    (_with(instance=None), "'instance' field is a NoneType"),
    (_with(shape={"route": 5}), "'route'"),
    (_with(outcome={"status": 0}), "no HTTP status"),
    (_with(outcome={"status": "200"}), "'status'"),
    (_with(published="yes"), "'published'"),
])
def test_a_damaged_or_newer_record_is_a_format_error_saying_what_is_wrong(raw: str | bytes, says: str) -> None:
    with pytest.raises(FormatError) as info:
        Record.from_json(raw)
    assert says in str(info.value) and len(str(info.value)) < 120


# -- in Redis ---------------------------------------------------------------------------------------------------
@pytest.fixture
def store() -> Iterator[Requests]:
    client = redis.Redis.from_url(REDIS_URL)
    keys = Keys(f"req-unit-{uuid.uuid4().hex[:8]}")
    leases = keys.inflight + ":instances"
    client.zadd(leases, {"alive": float(client.time()[0]) + 600})
    try:
        yield Requests(client, keys, ttl_s=60, leases_key=leases, status_of=status_of)  # as an API process's
    finally:
        client.delete(*client.keys(f"{keys.namespace}:*") or ["none"])


def test_two_keys_under_one_request_id_keep_their_own_calls(store: Requests) -> None:
    """What a tracer reusing X-Request-Id did to the calls behind two keys: the second no longer replaces the
    first; the id names the latest; releasing one touches nothing of the other's."""
    one, two = Idempotency("order-1", "b1"), Idempotency("order-2", "b2")
    first, second = keyed(record(), one), keyed(record(), two)
    assert store.claim(first, one, NOW).claimed and store.claim(second, two, NOW).claimed
    store.published([first, second])
    held = store.peek("t", one).view
    assert held is not None and held.record == replace(first, published=True)
    latest = store.look("t", "rid")
    assert latest is not None and latest.record.items == second.items
    # a third call without a key reuses the id, and is refused: forgetting it leaves both keys' calls as they were
    refused = record()
    store.client.set(store.record_key(refused), refused.to_json())
    store.release(refused, None)
    assert store.look("t", "rid") is None  # its own record went; the pointer it replaced is not brought back
    assert store.peek("t", one).view is not None and store.peek("t", two).view is not None
    # the second key's call refused late (a stream abandoned): its claim and record go, the first's stay
    store.release(replace(second, published=True), two)
    assert store.peek("t", two).claimed and store.peek("t", one).view is not None


def test_a_refused_call_does_not_delete_a_later_calls_record_under_its_id(store: Requests) -> None:
    earlier, later = record(), record()
    store.client.set(store.record_key(later), later.to_json())  # the later call reused the id and was recorded
    store.release(earlier, None)
    found = store.look("t", "rid")
    assert found is not None and found.record == later


def test_a_pointer_names_its_call_only_while_the_key_does(store: Requests) -> None:
    idem = Idempotency("order-1", "b")
    first = keyed(record("first-id"), idem)
    assert store.claim(first, idem, NOW).claimed
    store.release(first, idem)  # refused: the key is free, and claimed again by a call under another id
    assert store.look("t", "first-id") is None
    again = keyed(record("second-id"), idem)
    assert store.claim(again, idem, NOW).claimed
    store.client.set(store.keys.request("t", "first-id"), json.dumps({"at": store.record_key(again),
                                                                      "item": first.items[0]}))
    assert store.look("t", "first-id") is None, "a stale pointer must not show another call"
    found = store.look("t", "second-id")
    assert found is not None and found.record.items == again.items


def test_a_claim_from_before_records_lived_under_their_key_is_still_honoured(store: Requests) -> None:
    """A rolling upgrade: the claim an earlier version wrote names its record by request id."""
    idem = Idempotency("order-1", "b")
    old = replace(record("old-id"), published=True)
    store.client.set(store.keys.request("t", "old-id"), old.to_json())
    store.client.set(store.keys.idempotency("t", idem.key_hash),
                     json.dumps({"body": "b", "request_id": "old-id", "item": old.items[0]}))
    held = store.claim(keyed(record("new-id"), idem), idem, NOW)
    assert held.view is not None and held.view.record == old and held.same_body
    store.release(old, idem)  # its results expired: forgotten, so that a retry runs (it must not spin on the key)
    assert store.peek("t", idem).claimed and store.look("t", "old-id") is None


@pytest.mark.parametrize("damaged", ["not JSON", "no instance", "a newer format"])
def test_an_unreadable_record_is_record_unreadable_for_its_key_and_its_id_never_a_free_key(store: Requests,
                                                                                         damaged: str) -> None:
    idem = Idempotency("order-1", "b")
    first = keyed(record(), idem)
    assert store.claim(first, idem, NOW).claimed
    damage = {"not JSON": b"{not json", "no instance": json.dumps({"items": list(first.items)}).encode(),
              "a newer format": json.dumps({**json.loads(first.to_json()), "v": 9}).encode()}[damaged]
    store.client.set(store.record_key(first), damage)
    for ask in (lambda: store.claim(keyed(record("retry"), idem), idem, NOW), lambda: store.peek("t", idem)):
        with pytest.raises(RecordUnreadable, match="It may have run, so it is not run again") as info:
            ask()
        assert "'rid'" in info.value.message and status_of(info.value.type) == 409
    with pytest.raises(RecordUnreadable, match="request 'rid' is recorded in a form this server cannot read"):
        store.look("t", "rid")
    assert store.client.get(store.record_key(first)) == damage  # nothing was claimed over it


def test_an_unreadable_claim_is_record_unreadable_too(store: Requests) -> None:
    idem = Idempotency("order-1", "b")
    store.client.set(store.keys.idempotency("t", idem.key_hash), b"\x00\x01")
    with pytest.raises(RecordUnreadable, match="its claim is not the JSON"):
        store.claim(keyed(record(), idem), idem, NOW)


def test_an_unreadable_result_is_record_unreadable(store: Requests) -> None:
    made = record()
    store.client.set(store.keys.result(made.items[0]), b"{oops")
    with pytest.raises(RecordUnreadable, match="a result of it cannot be read"):
        store.results(made)


def test_another_calls_record_under_a_key_is_damage_not_a_free_key(store: Requests) -> None:
    """Under its key a record is only ever its claim's call's (writes are conditional): one naming other items is
    damage, and the key is not run again."""
    idem = Idempotency("order-1", "b")
    first = keyed(record(), idem)
    assert store.claim(first, idem, NOW).claimed
    store.client.set(store.record_key(first), record().to_json())
    with pytest.raises(RecordUnreadable):
        store.peek("t", idem)


def test_a_call_whose_key_was_taken_over_does_not_overwrite_the_new_record(store: Requests) -> None:
    """A call whose process stalled past its lease before publishing: a retry took its key over. Its late marks
    (published, finished) leave the retry's record alone."""
    idem = Idempotency("order-1", "b")
    stalled = keyed(record("stalled", instance="gone"), idem)
    assert store.claim(stalled, idem, NOW).claimed
    retry = keyed(record("retry"), idem)
    assert store.claim(retry, idem, NOW).claimed  # never published, its process holds no lease: taken over
    store.published([stalled])
    store.finish(stalled, Outcome(), idem, NOW)
    held = store.peek("t", idem).view
    assert held is not None and held.record == retry
    store.published([retry])
    store.finish(retry, Outcome(total_ms=3.0), idem, NOW)
    done = store.peek("t", idem).view
    assert done is not None and done.record == replace(retry, outcome=Outcome(total_ms=3.0))


def test_a_finished_call_is_stored_with_its_status_for_the_version_before_types(store: Requests) -> None:
    """The status comes from the table the store was given (the web layer's); a store given none (the CLI's)
    writes 500 for every failure: only versions from before errors were types read it."""
    made = record()
    store.finish(made, Outcome("queue_full", "full"), None, NOW)
    raw = store.client.get(store.record_key(made))
    assert raw is not None and json.loads(raw)["outcome"]["status"] == 429
    assert Record.from_json(raw).outcome == Outcome("queue_full", "full")
    plain = Requests(store.client, store.keys, ttl_s=60, leases_key=store.leases_key)
    plain.finish(made, Outcome("queue_full", "full"), None, NOW)
    raw = store.client.get(store.record_key(made))
    assert raw is not None and json.loads(raw)["outcome"]["status"] == 500


def test_a_record_redis_lost_is_told_apart_from_one_taken_over(store: Requests) -> None:
    """Marking a call's record sent: True while it is the call's, False when a retry took its key over (that
    call must not be sent), None when the record is gone (Redis restarted between its admission and its
    publish: nobody holds the key, so the call is refused as retryable, not as a conflict)."""
    idem = Idempotency("order-1", "b")
    stalled = keyed(record("stalled", instance="gone"), idem)
    assert store.claim(stalled, idem, NOW).claimed
    retry = keyed(record("retry"), idem)
    assert store.claim(retry, idem, NOW).claimed
    lost = keyed(record("lost"), Idempotency("order-2", "b"))
    assert store.claim(lost, Idempotency("order-2", "b"), NOW).claimed
    store.client.delete(store.record_key(lost))  # what a restart of Redis without persistence does
    assert store.published([retry, stalled, lost], sending=True) == [True, False, None]
