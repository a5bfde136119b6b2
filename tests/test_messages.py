"""The request message format: the calls of one round at the door, and the one-call body of earlier versions."""
from __future__ import annotations

import json

import pytest

from tasks.broker.queues import request_body, requests_of
from tasks.schema import InferenceRequest, Item


def call(rid: str) -> InferenceRequest:
    return InferenceRequest(id=rid, tenant="t", model="sim", items=(Item(f"{rid}.0", "hello"),), accepted_at=1.0,
                            deadline=5.0, reply_to="r")


def test_a_message_carries_the_calls_of_a_round_and_the_one_call_body_still_reads() -> None:
    calls = [call("a"), call("b")]
    assert requests_of(request_body(calls)) == calls
    assert requests_of(json.dumps(call("old").to_dict())) == [call("old")]  # from an API process not yet upgraded


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"requests": []}', b'{"requests": [{"id": 1}]}',
                                  b'{"requests": 7}', b'"text"'])
def test_a_malformed_message_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError, match="request message"):
        requests_of(body)


def test_a_batch_event_carries_when_it_happened_and_older_workers_events_still_read() -> None:
    from tasks.schema import BatchEvent

    event = BatchEvent("gpu0@h", "b1", "started", at=1_700_000_000.25, idle_ms=12.5)
    assert BatchEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    old = BatchEvent.from_dict({"worker": "gpu0@h", "batch_id": "b1", "event": "started"})
    assert old.at is None and old.idle_ms is None
