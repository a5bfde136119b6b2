"""The gateway alone (tasks/gateway/gateway.py): admit, refuse, publish, wait, on in-memory fakes of its parts and an
injected clock. No Redis, no broker: each fake keeps what it was asked, so a test reads what the gateway did.

The gateway through real Redis and RabbitMQ is tested end to end (tests/test_pipeline.py, tests/test_admission.py,
tests/test_front_door.py); here each of its rules is tested by itself.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest
import redis
from kombu.exceptions import OperationalError

from tasks.broker.queues import RequestPublisher
from tasks.config import Settings
from tasks.errors import DeadlineExceeded, ModelNotFound, Overloaded, QueueFull, TenantOverLimit, Unavailable
from tasks.gateway.admission_queue import ROOM_PRUNE_S, AdmissionQueue
from tasks.gateway.calls import Call
from tasks.gateway.gateway import Gateway
from tasks.gateway.parts import GatewayParts
from tasks.policy.refusal import AdmissionVerdict
from tasks.schema import InferenceRequest, ItemResult, Priority, WorkerInfo
from tasks.state.admission import Admission, AdmitCall, CollectCall, Decision, Ticket
from tasks.state.fleet import KNOWN_FOR_S, Fleet, FleetCache
from tasks.state.journal import Journal
from tasks.state.records import Idempotency, Outcome, Record
from tasks.state.requests import Requests
from tasks.state.results import ResultListener, _Waiter
from tests.fakes import FakeClock

MODEL = "sim"


def worker(model: str = MODEL) -> WorkerInfo:
    return WorkerInfo(id=f"gpu0@{model}", queue="q", model=model, max_batch=8, state="idle", outstanding=0,
                      completed=1, batch_started_at=None, batch_ms_estimate=0.0, heartbeat_at=0.0)


class FakeAdmission:
    """Admission's script, as a list of verdicts to give (then OK); what was admitted and released."""

    def __init__(self) -> None:
        self.verdicts: list[Decision] = []
        self.admitted: list[AdmitCall] = []
        self.released: list[str] = []
        self.down = False  # Redis away

    def try_admit_many(self, calls: Sequence[AdmitCall], valid_until: float | None = None) -> list[Decision]:
        if self.down:
            raise redis.ConnectionError("Connection refused")
        decisions = []
        for call in calls:
            decision = self.verdicts.pop(0) if self.verdicts else Decision(AdmissionVerdict.OK, ahead=1)
            if decision.verdict is AdmissionVerdict.OK:
                self.admitted.append(call)
            decisions.append(decision)
        return decisions

    def collect_many(self, calls: Sequence[CollectCall]) -> list[tuple[list[bytes | None], bool]]:
        return [([None] * len(c.item_ids), False) for c in calls]

    def release(self, ticket: Ticket, item_ids: Sequence[str]) -> None:
        self.released += item_ids

    def renew(self) -> int:  # the lease's
        return 0


class FakeRequests:
    """The call records: what was written, and each call's outcome."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.outcomes: dict[str, Outcome] = {}
        self.dropped: list[str] = []

    def admitted(self, record: Record, now: float) -> tuple[str, str, int]:
        self.records.append(record)
        return f"rec:{record.request_id}", "{}", 60

    def finish(self, record: Record, outcome: Outcome, idem: Idempotency | None, now: float,
               written_at: float | None = None) -> None:
        self.outcomes[record.request_id] = outcome

    def published(self, records: Sequence[Record], *, sending: bool = False) -> list[bool]:
        return [True] * len(records)

    def release(self, record: Record, idem: Idempotency | None) -> None:
        self.dropped.append(record.request_id)


class FakeFleet:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers
        self.stale_after_s = math.inf  # every worker in the hash is live

    def all(self) -> list[WorkerInfo]:
        return list(self.workers)

    def live(self, now: float, *, draining: bool = False) -> list[WorkerInfo]:
        return list(self.workers)


@dataclass
class Device:
    """The broker and the workers behind it: each request published is answered (unless ``answers`` is off), or
    publishing fails with ``failure``."""

    answers: bool = True
    failure: Exception | None = None
    published: list[InferenceRequest] = field(default_factory=list)
    results: dict[str, ItemResult] = field(default_factory=dict)

    def publish(self, requests: Sequence[InferenceRequest], timeout_s: float) -> None:
        if self.failure is not None:
            raise self.failure
        self.published += requests
        if self.answers:
            for request in requests:
                for item in request.items:
                    self.results[item.id] = ItemResult(output=f"ran {item.input}", batch_id="b1", worker="gpu0")


class FakeListener:
    """The result listener: the device's results as they are; a wait with some missing lasts until its deadline
    (the fake clock moved there)."""

    channel = "replies:test"

    def __init__(self, device: Device, clock: FakeClock) -> None:
        self.device = device
        self.clock = clock
        self.expected: list[str] = []
        self.forgotten: list[str] = []

    def expect(self, item_ids: Sequence[str]) -> _Waiter:
        self.expected += item_ids
        return _Waiter()

    def forget(self, item_ids: Sequence[str], waiter: _Waiter) -> None:
        self.forgotten += item_ids

    def wait(self, item_ids: Sequence[str], deadline: float, read: Any = None,
             waiter: _Waiter | None = None) -> dict[str, ItemResult]:
        found = {i: self.device.results[i] for i in item_ids if i in self.device.results}
        if len(found) < len(item_ids):
            self.clock.now = max(self.clock.now, deadline)
        return found


class FakeClient:
    """Redis, as far as the gateway publishes on it (cancellations)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str]] = []

    def publish(self, channel: str, message: str) -> int:
        self.messages.append((channel, message))
        return 1


@dataclass
class Rig:
    gateway: Gateway
    queue: AdmissionQueue
    clock: FakeClock
    admission: FakeAdmission
    requests: FakeRequests
    device: Device
    listener: FakeListener
    client: FakeClient

    def call(self, *inputs: str, timeout_ms: int = 5000, tenant: str = "alice") -> Call:
        return Call(f"req-{len(self.requests.records)}-{self.clock()}", tenant, MODEL, inputs or ("x",), timeout_ms,
                    received_at=self.clock())


@pytest.fixture
def rig() -> Rig:
    settings = Settings.of()
    clock = FakeClock()
    admission, requests, device, client = FakeAdmission(), FakeRequests(), Device(), FakeClient()
    listener = FakeListener(device, clock)
    workers = FleetCache(cast(Fleet, FakeFleet([worker()])), 1.0, clock=clock, wallclock=clock)
    parts = GatewayParts("api-1", cast(redis.Redis, client), clock, cast(Admission, admission),
                         cast(Requests, requests), workers, cast(ResultListener, listener), cast(Journal, None),
                         cast(RequestPublisher, device))
    queue = AdmissionQueue(settings, workers, clock=clock)
    gateway = Gateway(settings, parts, queue, monotonic=clock)
    return Rig(gateway, queue, clock, admission, requests, device, listener, client)


def test_an_admitted_call_is_recorded_published_and_answered(rig: Rig) -> None:
    answer = rig.gateway.submit(rig.call("a", "b"))
    assert [r.output for r in answer.results] == ["ran a", "ran b"]
    [request] = rig.device.published
    assert [i.input for i in request.items] == ["a", "b"] and request.reply_to == FakeListener.channel
    assert [r.request_id for r in rig.requests.records] == [request.id]  # recorded with its admission
    assert list(rig.admission.admitted[0].item_ids) == [i.id for i in request.items]
    assert rig.listener.expected == [i.id for i in request.items], "listened for before publishing"
    assert not rig.requests.outcomes[request.id].failed
    assert request.deadline == pytest.approx(rig.clock() + 5.0)  # on the shared clock, from its arrival


def test_a_full_model_refuses_the_call_and_the_queue_holds_the_verdict_for_the_next(rig: Rig) -> None:
    rig.admission.verdicts = [Decision(AdmissionVerdict.FULL, ahead=40)]
    with pytest.raises(QueueFull) as refused:
        rig.gateway.submit(rig.call())
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    assert rig.device.published == [] and rig.listener.expected == []
    held = rig.queue.held_full(MODEL, Priority.INTERACTIVE)
    assert held is not None and rig.queue.holds_full(), "the door sees the FULL verdict"
    asked = len(rig.admission.admitted)
    with pytest.raises(QueueFull):  # refused from the held verdict, admission not asked
        rig.gateway.submit(rig.call())
    assert rig.admission.verdicts == [] and len(rig.admission.admitted) == asked
    rig.clock.advance(1.0)  # the verdict is no longer fresh: admission is asked again, and lets it in
    assert rig.gateway.submit(rig.call()).results[0].output == "ran x"


def test_a_tenant_over_its_cap_is_refused_and_nothing_is_published(rig: Rig) -> None:
    rig.admission.verdicts = [Decision(AdmissionVerdict.TENANT_FULL, ahead=3)]
    with pytest.raises(TenantOverLimit):
        rig.gateway.submit(rig.call())
    assert rig.device.published == [] and not rig.queue.holds_full()


def test_admission_without_redis_is_503_and_the_queue_view_lets_the_call_go(rig: Rig) -> None:
    rig.admission.down = True
    rig.queue.room.let_in((MODEL, Priority.INTERACTIVE))  # the door let it in as it arrived
    with pytest.raises(Unavailable, match="Redis is unreachable"):
        rig.gateway.submit(rig.call())
    assert rig.device.published == [] and rig.queue.room.waiting() == 0, "no longer counted as waiting"


def test_a_failed_publish_is_503_and_the_admission_undone(rig: Rig) -> None:
    rig.device.failure = OperationalError("connection refused")
    call = rig.call("a", "b")
    with pytest.raises(Unavailable, match="RabbitMQ is unreachable"):
        rig.gateway.submit(call)
    [admitted] = rig.admission.admitted
    assert sorted(rig.admission.released) == sorted(admitted.item_ids), "its items released"
    assert sorted(rig.listener.forgotten) == sorted(admitted.item_ids), "no one listens for them"
    assert rig.requests.dropped == [call.request_id], "its record dropped: a retry runs it again"


def test_a_known_model_no_live_worker_serves_is_503_after_admission_and_released(rig: Rig) -> None:
    fleet = cast(FakeFleet, rig.queue.workers.fleet)
    fleet.stale_after_s = 1e6  # the model's only worker is in the hash, its heartbeat long stale
    fleet.workers.append(replace(worker("other"), heartbeat_at=-1e9))
    call = Call("r-none", "alice", "other", ("x",), 5000, received_at=rig.clock())
    with pytest.raises(Unavailable, match="no live GPU worker serves model 'other'"):
        rig.gateway.submit(call)
    assert rig.device.published == [] and list(rig.admission.released) == list(rig.admission.admitted[0].item_ids)


def test_a_model_the_fleet_does_not_know_is_404_before_anything_is_kept(rig: Rig) -> None:
    for i in range(50):
        call = Call(f"r-{i}", "alice", f"made-up-{i}", ("x",), 5000, received_at=rig.clock())
        with pytest.raises(ModelNotFound, match=f"'made-up-{i}' is not served here .*sim"):
            rig.gateway.submit(call)
    assert rig.admission.admitted == [] and rig.device.published == [] and rig.requests.records == []
    assert len(rig.queue.room) == 0 and rig.queue.full.verdicts == {}


def test_a_model_whose_first_worker_just_beat_is_served_at_once(rig: Rig) -> None:
    fleet = cast(FakeFleet, rig.queue.workers.fleet)
    rig.gateway.live_workers()  # the cache read before the new worker's first heartbeat
    fleet.workers.append(worker("new"))
    rig.clock.advance(0.2)  # past the recheck, within the cache's age
    call = Call("r-new", "alice", "new", ("x",), 5000, received_at=rig.clock())
    assert rig.gateway.submit(call).results[0].output == "ran x"


def test_a_call_whose_answer_does_not_come_by_its_deadline_is_504_recorded_and_cancelled(rig: Rig) -> None:
    rig.device.answers = False
    call = rig.call("a", timeout_ms=2000)
    with pytest.raises(DeadlineExceeded):
        rig.gateway.submit(call)
    [request] = rig.device.published
    item = request.items[0].id
    assert rig.clock() == pytest.approx((call.received_at or 0.0) + 2.0)  # it waited it out
    assert rig.requests.outcomes[call.request_id].type == "deadline_exceeded"
    assert rig.client.messages and rig.client.messages[0][1] == item, "the worker told to stop"
    assert rig.admission.released == [item]


def test_a_call_whose_time_passed_before_it_was_reached_is_refused_before_admission(rig: Rig) -> None:
    call = rig.call(timeout_ms=1000)
    rig.clock.advance(1.5)  # the process got to it after its deadline
    with pytest.raises(Overloaded):
        rig.gateway.submit(call)
    assert rig.admission.admitted == [] and rig.device.published == []


def test_the_fleet_knows_every_model_in_its_hash_and_lately_seen_reading_it_rarely_for_the_unknown() -> None:
    clock = FakeClock()
    fake = FakeFleet([worker(), replace(worker("down"), heartbeat_at=-1e9)])
    fake.stale_after_s = 1e6
    reads = 0

    def counted() -> list[WorkerInfo]:
        nonlocal reads
        reads += 1
        return list(fake.workers)

    fake.all = counted  # type: ignore[method-assign]
    cache = FleetCache(cast(Fleet, fake), 1.0, clock=clock, wallclock=clock)
    assert cache.knows(MODEL, 0.1) and cache.knows("down", 0.1), "a stale worker's model is known"
    assert [w.model for w in cache.last] == [MODEL]
    for i in range(10_000):  # a flood of made-up names within a tenth of a second: no read of the hash
        assert not cache.knows(f"made-up-{i}", 0.1)
    assert reads == 1
    clock.advance(0.2)
    assert not cache.knows("made-up", 0.1) and reads == 2
    fake.workers = [worker()]  # the down worker is removed from the hash: its model stays known a while
    clock.advance(60.0)
    cache.get()
    assert cache.knows("down", 0.1)
    clock.advance(KNOWN_FOR_S)
    cache.get()
    assert not cache.knows("down", 0.1) and cache.knows(MODEL, 0.1)


def test_a_caller_that_finds_the_fleet_being_read_for_a_new_model_waits_for_that_read() -> None:
    """Calls for a model whose worker has just joined, into a view read before it did (an API process reads the
    fleet as it starts): the first reads the hash again; one coming while that read is in flight used to answer
    from the old view, a 404 (CI). It waits for the read and knows the model. Callers for a made-up name
    waiting meanwhile take that read's answer too, even when the read outlasted the recheck period (0.3 s
    here, as under a burst): the hash is read once for all of them."""
    clock = FakeClock()
    fake = FakeFleet([])
    fake.stale_after_s = 1e6
    cache = FleetCache(cast(Fleet, fake), 1.0, clock=clock, wallclock=clock)
    assert cache.get() == []  # read as the process started: no worker yet
    fake.workers = [worker()]  # the worker joins
    reading, release, reads = threading.Event(), threading.Event(), [0]

    def slow_read() -> list[WorkerInfo]:
        reads[0] += 1
        reading.set()
        release.wait(10)  # the read waits for Redis; other callers come meanwhile
        clock.advance(0.3)
        return list(fake.workers)

    fake.all = slow_read  # type: ignore[method-assign]
    answers: dict[str, list[bool]] = {}

    def ask(name: str, model: str) -> threading.Thread:
        answers[name] = []
        thread = threading.Thread(target=lambda: answers[name].append(cache.knows(model, 0.1)))
        thread.start()
        return thread

    first = ask("first", MODEL)
    assert reading.wait(10)
    others = [ask("second", MODEL), *(ask(f"made-up-{i}", f"made-up-{i}") for i in range(5))]
    for thread in others:
        thread.join(0.05)
    assert all(thread.is_alive() for thread in others), "the callers wait for the read in flight"
    release.set()
    for thread in [first, *others]:
        thread.join(10)
    assert answers.pop("first") == [True] and answers.pop("second") == [True]
    assert all(answer == [False] for answer in answers.values()) and reads == [1]


def test_an_old_view_of_the_fleet_is_read_again_by_one_caller_the_others_go_on_with_it() -> None:
    """Under a burst every arrival found the view old at once and read the hash (hundreds of reads, traced),
    taking the process's Redis connections from the admission rounds. One caller reads; those coming while its
    read is in flight take the view before it, without waiting; a caller asking for a fresh view still reads."""
    clock = FakeClock()
    fake = FakeFleet([worker()])
    fake.stale_after_s = 1e6
    cache = FleetCache(cast(Fleet, fake), 1.0, clock=clock, wallclock=clock)
    assert [w.model for w in cache.get()] == [MODEL]
    clock.advance(2.0)  # the view is old
    fake.workers = [worker(), worker("other")]
    reading, release, reads = threading.Event(), threading.Event(), [0]

    def slow_read() -> list[WorkerInfo]:
        reads[0] += 1
        reading.set()
        release.wait(10)
        return list(fake.workers)

    fake.all = slow_read  # type: ignore[method-assign]
    seen: list[list[str]] = []
    reader = threading.Thread(target=lambda: seen.append([w.model for w in cache.get()]))
    reader.start()
    assert reading.wait(10)
    others = [[w.model for w in cache.get()] for _ in range(20)]  # would block on the read, were they to read
    assert others == [[MODEL]] * 20 and reads == [1]
    release.set()
    reader.join(10)
    assert seen == [[MODEL, "other"]] and reads == [1]
    fake.all = lambda: list(fake.workers)  # type: ignore[method-assign]
    assert len(cache.get()) == 2 and len(cache.get(fresh=True)) == 2


def test_the_queue_drops_the_lines_of_models_no_longer_served(rig: Rig) -> None:
    fleet = cast(FakeFleet, rig.queue.workers.fleet)
    fleet.workers.append(worker("other"))
    rig.gateway.live_workers(fresh=True)
    for model in (MODEL, "other"):
        rig.queue.decided(model, Priority.INTERACTIVE, AdmissionVerdict.OK, 3, None)
    assert len(rig.queue.room) == 2
    fleet.workers.pop()  # "other"'s worker is gone
    rig.clock.advance(ROOM_PRUNE_S + 1)
    rig.gateway.live_workers(fresh=True)
    rig.queue.decided(MODEL, Priority.INTERACTIVE, AdmissionVerdict.OK, 3, None)
    assert len(rig.queue.room) == 1


def test_the_default_model_is_known_before_any_worker_of_it_beat(rig: Rig) -> None:
    cast(FakeFleet, rig.queue.workers.fleet).workers.clear()  # a fleet not up yet
    with pytest.raises(Unavailable, match="no live GPU worker serves model 'sim'"):
        rig.gateway.submit(rig.call())
