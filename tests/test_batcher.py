"""The batcher's guarantees from the decisions it returns, with a fake clock and the consumer's part played by a
recorder (each batch decided taken as published, then its messages acknowledged)."""
from __future__ import annotations

from collections import Counter

import pytest

from tasks.policy.batcher import EXPIRED, Batcher, BatcherConfig
from tasks.policy.flush import FlushPolicy
from tasks.policy.scheduler_output import Drop, SchedulerOutput, Send
from tasks.policy.wait import WaitPolicy
from tasks.schema import Batch, InferenceRequest, Item, Priority, SamplingParams, WorkerInfo
from tests.fakes import FakeClock


def worker(wid: str) -> WorkerInfo:
    return WorkerInfo(id=wid, queue=f"q.{wid}", model="sim", max_batch=100, state="idle", outstanding=0,
                      completed=0, batch_started_at=None, batch_ms_estimate=0.0, heartbeat_at=0.0)


class Harness:
    def __init__(self, size: int = 3, wait_s: float = 0.020, workers: int = 1, max_outstanding: int = 2,
                 wait: WaitPolicy | None = None) -> None:
        self.clock = FakeClock(start=1_000.0)
        self.sent: list[tuple[Batch, str]] = []
        self.acked: list[str] = []
        self.workers = [worker(f"w{i}") for i in range(workers)]
        self.batcher = Batcher(BatcherConfig(FlushPolicy(size, wait_s), wait, max_outstanding=max_outstanding),
                               lambda: self.workers, clock=self.clock, wallclock=self.clock)

    def record(self, out: SchedulerOutput) -> float | None:
        """Take the batcher's decisions as a consumer whose every publish succeeds; when to poll next."""
        for message in [*out.acks, *(m for step in out.steps for m in step.acks)]:
            message.ack()
        self.sent += [(s.batch, s.worker.id) for s in out.sends]
        return out.next_poll_s

    def poll(self) -> float | None:
        return self.record(self.batcher.poll())

    def started(self, worker_id: str, batch_id: str, at: float | None = None) -> float | None:
        return self.record(self.batcher.started(worker_id, batch_id, at))

    def finished(self, worker_id: str, batch_id: str, run_s: float | None = None,
                 took: dict[str, int] | None = None) -> float | None:
        return self.record(self.batcher.finished(worker_id, batch_id, run_s, took))

    def request(self, rid: str, n_items: int = 1, timeout_s: float = 30.0, tenant: str = "default",
                priority: Priority = Priority.INTERACTIVE) -> InferenceRequest:
        now = self.clock.now
        return InferenceRequest(id=rid, tenant=tenant, model="sim",
                                items=tuple(Item(f"{rid}.{i}", f"text {rid} {i}") for i in range(n_items)),
                                accepted_at=now, deadline=now + timeout_s, reply_to="r", priority=priority)

    def submit(self, rid: str, n_items: int = 1, timeout_s: float = 30.0, tenant: str = "default",
               priority: Priority = Priority.INTERACTIVE) -> float | None:
        return self.record(self.add(rid, n_items, timeout_s, tenant, priority))

    def add(self, rid: str, n_items: int = 1, timeout_s: float = 30.0, tenant: str = "default",
            priority: Priority = Priority.INTERACTIVE) -> SchedulerOutput:
        """The batcher's decisions on a request, not yet carried out."""
        return self.batcher.add(self.request(rid, n_items, timeout_s, tenant, priority), lambda: self.acked.append(rid))


def test_full_batch_is_sent_at_once_and_acked_only_after_dispatch() -> None:
    h = Harness(size=3)
    assert h.add("a").steps == () and h.add("b").steps == ()
    (send,) = h.add("c").steps  # one decision: this batch to that worker, then these messages acknowledged
    assert isinstance(send, Send) and send.worker.id == "w0"
    assert [i.request_id for i in send.batch.items] == ["a", "b", "c"]
    assert h.acked == []  # nothing is acknowledged by the batcher itself: the consumer does, once it is published
    for message in send.acks:
        message.ack()
    assert h.acked == ["a", "b", "c"]


def test_wait_trigger_through_poll() -> None:
    h = Harness(size=100, wait_s=0.020)
    delay = h.submit("a")
    assert delay == pytest.approx(0.020)
    h.clock.advance(0.010)
    assert h.poll() == pytest.approx(0.010)
    assert h.sent == []
    h.clock.advance(0.010)
    assert h.poll() is None
    assert len(h.sent) == 1 and h.acked == ["a"]


def test_expired_items_never_run_but_their_message_is_acked() -> None:
    h = Harness(size=100)
    h.submit("short", timeout_s=0.005)
    h.submit("long", timeout_s=10)
    h.clock.advance(0.030)
    drop, send = h.batcher.poll().steps
    assert isinstance(drop, Drop) and [i.request_id for i in drop.items] == ["short"]
    assert (drop.status, drop.reason) == ("expired", EXPIRED)
    assert isinstance(send, Send) and [i.request_id for i in send.batch.items] == ["long"]
    for message in drop.acks + send.acks:  # each message acknowledged after its own step
        message.ack()
    assert h.acked == ["short", "long"]
    assert h.batcher.stats["expired_items"] == 1


def test_a_multi_item_message_is_acked_when_its_last_item_is_dispatched() -> None:
    h = Harness(size=3)
    h.submit("big", n_items=5)  # 3 go now, 2 wait
    assert len(h.sent) == 1 and h.acked == []
    h.clock.advance(0.020)
    h.poll()
    assert len(h.sent) == 2 and h.acked == ["big"]


def test_a_message_of_several_calls_is_acked_once_every_item_of_every_call_is_dispatched() -> None:
    """A message carries the calls of one round at the door: one ack, after the last of their items is handed on
    (a batcher killed before that leaves the whole message to be redelivered)."""
    h = Harness(size=3)
    now = h.clock.now
    calls = [InferenceRequest(id=rid, tenant="default", model="sim",
                              items=tuple(Item(f"{rid}.{i}", f"text {rid} {i}") for i in range(n)),
                              accepted_at=now, deadline=now + 30, reply_to="r") for rid, n in (("x", 2), ("y", 2))]
    out = h.batcher.add_message(calls, lambda: h.acked.append("message"))
    assert h.record(out) is not None  # one item left waiting
    assert len(h.sent) == 1 and h.acked == []
    h.clock.advance(0.020)
    h.poll()
    assert [[i.request_id for i in b.items] for b, _ in h.sent] == [["x", "x", "y"], ["y"]]
    assert h.acked == ["message"]


def test_failed_dispatch_keeps_items_unacked_and_retries() -> None:
    h = Harness(size=2)
    h.submit("a")
    out = h.add("b")
    assert len(out.sends) == 1
    assert h.batcher.unsent(out.steps) == SchedulerOutput()  # the broker refused it: it goes back, held
    assert h.acked == [] and len(h.batcher.buffers["sim"]) == 2 and h.batcher.held_by("w0") == []
    assert h.poll() is None and h.sent == []  # held until the next retry
    h.record(h.batcher.retry_held())  # what the batcher's periodic tick does
    assert h.acked == ["a", "b"]


def one_send_then_a_drop_completing_two_messages() -> tuple[Harness, SchedulerOutput]:
    """One flush: m's first item to w0, then m's second and x's only item dropped (they cannot finish on the
    slow w1 in time), which completes both messages."""
    h = Harness(size=1, workers=2, max_outstanding=1)
    h.batcher.scheduler.finished("w1", "warm-up", run_s=0.250)  # batches take 250 ms on w1
    for wid in ("w0", "w1"):
        h.batcher.scheduler.sent(wid, f"busy-{wid}", h.clock.now)
    h.submit("m", n_items=2, timeout_s=0.2)
    h.submit("x", timeout_s=0.2)
    assert h.sent == []  # both workers busy: held
    for wid in ("w0", "w1"):
        h.batcher.scheduler.finished(wid, f"busy-{wid}")
    out = h.batcher.retry_held()
    send, drop = out.steps
    assert isinstance(send, Send) and send.worker.id == "w0" and send.acks == ()
    assert isinstance(drop, Drop) and [i.id for i in drop.items] == ["m.1", "x.0"] and len(drop.acks) == 2
    return h, out


def test_a_drop_after_a_refused_batch_is_acknowledged_only_where_it_does_not_wait_on_that_batch() -> None:
    """The broker refuses w0's batch: x is still acknowledged, m only once its first item is sent after all."""
    h, out = one_send_then_a_drop_completing_two_messages()
    back = h.batcher.unsent(out.steps)
    assert back.sends == [] and len(back.drops) == 1 and [i.id for i in back.drops[0].items] == ["m.1", "x.0"]
    h.record(back)
    assert h.acked == ["x"]
    h.record(h.batcher.retry_held())
    assert [i.id for b, _ in h.sent for i in b.items] == ["m.0"] and h.acked == ["x", "m"]


def test_the_consumer_publishes_then_records_and_acknowledges_and_hands_a_refused_batch_back() -> None:
    """The bootstep's part (tasks.broker.consumer) on the decisions above, with a broker that refuses, then
    takes, the batch."""
    from types import SimpleNamespace
    from typing import cast

    from tasks.broker.consumer import BatchingStep
    from tasks.store.ledger import ItemsOutcome

    h, out = one_send_then_a_drop_completing_two_messages()
    published: list[str] = []
    recorded: list[ItemsOutcome] = []
    armed: list[float | None] = []

    def send_task(name: str, args: list[dict[str, object]], queue: str, **_: object) -> None:
        if fake.refuse:
            raise ConnectionError("broker gone")
        published.append(queue)

    fake = SimpleNamespace(batcher=h.batcher, refuse=True, app=SimpleNamespace(send_task=send_task),
                           ledger=SimpleNamespace(record=recorded.append), _arm=armed.append)
    fake._publish = lambda send: BatchingStep._publish(cast(BatchingStep, fake), send)
    BatchingStep._carry_out(cast(BatchingStep, fake), out)
    assert published == [] and h.acked == ["x"] and armed == [None]  # held: the next tick retries it
    assert [(r.status, [i.id for i in r.items]) for r in recorded] == [("expired", ["m.1", "x.0"])]
    fake.refuse = False
    BatchingStep._carry_out(cast(BatchingStep, fake), h.batcher.retry_held())
    assert published == ["q.w0"] and h.acked == ["x", "m"]


def test_no_worker_holds_items_until_one_appears() -> None:
    h = Harness(size=2, workers=0)
    h.submit("a")
    assert h.submit("b") is None  # held: no per-message timer, the periodic poll retries
    assert h.sent == [] and h.acked == []
    h.workers = [worker("late")]
    h.record(h.batcher.retry_held())  # what the batcher's periodic tick does
    assert h.sent[0][1] == "late" and h.acked == ["a", "b"]


def test_work_conserving_batches_grow_while_workers_are_busy() -> None:
    h = Harness(size=100, wait_s=0.020, workers=1, max_outstanding=1)
    h.submit("first")
    h.clock.advance(0.020)
    h.poll()
    assert len(h.sent) == 1
    for i in range(150):  # arrive while the only worker is busy
        h.submit(f"r{i}")
        h.clock.advance(0.001)
    h.poll()
    assert len(h.sent) == 1, "nothing may queue behind a busy worker"
    h.finished("w0", h.sent[0][0].id, run_s=0.25)
    assert [len(b.items) for b, _ in h.sent] == [1, 100]


def test_the_waiting_batch_keeps_filling_until_the_running_one_is_nearly_done() -> None:
    h = Harness(size=100, wait_s=0.020, workers=1, max_outstanding=2)
    h.batcher.scheduler.finished("w0", "warm-up", run_s=0.250)  # the worker's batch time is known: 250 ms
    h.submit("first")
    h.clock.advance(0.020)
    h.poll()
    h.started("w0", h.sent[0][0].id)
    for i in range(40):  # 200 ms of arrivals while the first batch runs
        h.submit(f"r{i}")
        h.clock.advance(0.005)
        h.poll()
    assert len(h.sent) == 1, "a batch handed over now would stop filling for nothing"
    h.clock.advance(0.040)  # 15 ms before the running batch should end
    h.poll()
    assert [len(b.items) for b, _ in h.sent] == [1, 40]


def one_batch_sent_to_a_250_ms_worker() -> Harness:
    h = Harness(size=100, wait_s=0.020, workers=1, max_outstanding=2)
    h.batcher.scheduler.finished("w0", "warm-up", run_s=0.250)
    h.submit("first")
    h.clock.advance(0.020)
    h.poll()
    return h


def test_a_started_announcement_counts_from_when_the_batch_started_not_when_it_arrived() -> None:
    h = one_batch_sent_to_a_250_ms_worker()
    started = h.clock.now
    h.clock.advance(0.030)  # the announcement took 30 ms to get here (a saturated host)
    h.started("w0", h.sent[0][0].id, at=started)
    h.submit("next")
    h.clock.now = started + 0.250 - 0.015  # the lead before the batch's real end
    h.poll()
    assert [len(b.items) for b, _ in h.sent] == [1, 1], "dated by its arrival, it would go out 30 ms late"


def test_an_announcement_dated_far_back_is_believed_only_so_far() -> None:
    h = one_batch_sent_to_a_250_ms_worker()
    h.started("w0", h.sent[0][0].id, at=h.clock.now - 60)  # a clock that jumped
    h.submit("next")
    h.clock.advance(0.050)
    h.poll()
    assert len(h.sent) == 1, "a running batch must not look finished from a wrong date"


def test_batches_spread_over_workers_by_outstanding_work() -> None:
    h = Harness(size=1, workers=2, max_outstanding=2)
    for i in range(4):
        h.submit(f"r{i}")
    assert sorted(w for _, w in h.sent) == ["w0", "w0", "w1", "w1"]
    h.submit("r4")
    assert len(h.sent) == 4  # both full


def test_discard_all_leaves_everything_unacked_for_redelivery() -> None:
    h = Harness(size=10)
    h.submit("a")
    h.submit("b")
    assert h.batcher.discard_all() == 2
    assert h.acked == [] and h.poll() is None


def test_items_that_cannot_finish_in_time_on_the_chosen_worker_are_dropped() -> None:
    h = Harness(size=100, wait_s=0.020)
    h.batcher.scheduler.finished("w0", "warm-up", run_s=0.250)  # batches take 250 ms on w0
    h.submit("doomed", timeout_s=0.200)  # would still be running at its deadline
    h.submit("fine", timeout_s=1.0)
    h.clock.advance(0.020)
    h.poll()
    assert [i.request_id for b, _ in h.sent for i in b.items] == ["fine"]
    assert sorted(h.acked) == ["doomed", "fine"]


def test_a_flood_held_behind_busy_workers_does_not_delay_another_tenant() -> None:
    """The fairness scenario through the Batcher: A's 5,000 queued items, B's request still in the next batch."""
    h = Harness(size=100, max_outstanding=1)
    for k in range(50):
        h.submit(f"a{k}", n_items=100, tenant="a")
    assert len(h.sent) == 1  # the worker holds its one batch; the rest of A's flood waits in the buffer
    h.submit("b0", tenant="b")
    h.finished("w0", h.sent[0][0].id)
    assert "b0" in {i.request_id for i in h.sent[1][0].items}
    assert len(h.sent[1][0].items) == 100  # and A gets the rest of the batch


def test_interactive_requests_overtake_queued_offline_work() -> None:
    h = Harness(size=10, max_outstanding=1)
    h.submit("first", n_items=10, priority=Priority.OFFLINE)  # full: sent at once
    h.submit("job", n_items=30, priority=Priority.OFFLINE)
    h.submit("chat", n_items=2)
    h.finished("w0", h.sent[0][0].id)
    assert [i.request_id for i in h.sent[1][0].items][:2] == ["chat", "chat"]


def test_adaptive_wait_leaves_at_once_for_a_free_device_and_thin_traffic() -> None:
    h = Harness(size=100, wait=WaitPolicy("adaptive", fixed_s=0.020, min_s=0.001, max_s=0.050))
    delay = h.submit("a")
    assert delay == pytest.approx(0.001)
    h.clock.advance(0.001)
    h.poll()
    assert len(h.sent) == 1


def test_a_lost_workers_batches_are_kept_until_they_are_in_the_recovery_queue() -> None:
    """take_back against the real broker, with the second batch unpublishable: the first is handed on and
    forgotten, the second stays with the batcher for the next check (it used to be forgotten first)."""
    import uuid
    from dataclasses import replace

    import redis
    from kombu import Connection
    from kombu.exceptions import EncodeError

    from harness.stack import BROKER_URL, REDIS_URL
    from tasks.broker.queues import recovery_queue
    from tasks.broker.recovery import Recovery
    from tasks.state.claims import Claims
    from tasks.state.fleet import Fleet
    from tasks.state.quarantine import Quarantine
    from tasks.state.results import ResultWriter

    h = Harness(size=1, workers=1)
    h.submit("a")
    h.submit("b")
    _first, second = h.batcher.held_by("w0")
    unencodable = SamplingParams(unknown={"x": {1, 2}})
    broken = second.with_items(tuple(replace(i, params=unencodable) for i in second.items))
    worker_id, _, sent_at = h.batcher.in_flight[second.id]
    h.batcher.in_flight[second.id] = (worker_id, broken, sent_at)  # a set: JSON cannot encode it
    client = redis.Redis.from_url(REDIS_URL)
    ns = f"t{uuid.uuid4().hex[:10]}"
    recovery = Recovery(h.batcher, Fleet(client, f"{ns}:fleet", 3.0), Claims(client, f"{ns}:claim"),
                        Quarantine(client, f"{ns}:quarantine"), ResultWriter(client, lambda i: i, 60),
                        lambda event: None, lambda: Connection(BROKER_URL), recovery_queue(f"{ns}.recovery"))
    try:
        with pytest.raises(EncodeError):
            recovery.take_back("w0", h.workers[0].queue)
        assert [b.id for b in h.batcher.held_by("w0")] == [second.id]
    finally:
        with Connection(BROKER_URL) as conn:
            conn.default_channel.queue_delete(f"{ns}.recovery")


def test_a_worker_nobody_consumes_gets_no_batch_until_its_queue_has_a_consumer() -> None:
    """After a broker cut a worker's consumer reconnects while its heartbeat goes on. The check takes its batch back
    once; then no batch goes to it (the next check would take each back again, charging a retry every time: a whole
    batch ended 503 retries_exhausted in CI) until its queue has a consumer again. Real broker and Redis."""
    import uuid
    from dataclasses import replace

    import redis
    from kombu import Connection

    from harness.stack import BROKER_URL, REDIS_URL
    from tasks.broker.queues import recovery_queue
    from tasks.broker.recovery import Recovery
    from tasks.state.claims import Claims
    from tasks.state.fleet import Fleet
    from tasks.state.quarantine import Quarantine
    from tasks.state.results import ResultWriter

    ns = f"t{uuid.uuid4().hex[:10]}"
    h = Harness(size=1, workers=1)
    h.workers = [replace(worker("w0"), queue=f"{ns}.gpu.w0", heartbeat_at=h.clock.now)]
    client = redis.Redis.from_url(REDIS_URL)
    fleet = Fleet(client, f"{ns}:fleet", 3.0)
    fleet.beat(h.workers[0])
    recovery = Recovery(h.batcher, fleet, Claims(client, f"{ns}:claim"), Quarantine(client, f"{ns}:quarantine"),
                        ResultWriter(client, lambda i: i, 60), lambda event: None, lambda: Connection(BROKER_URL),
                        recovery_queue(f"{ns}.recovery"))
    with Connection(BROKER_URL) as conn:
        channel = conn.channel()
        channel.queue_declare(h.workers[0].queue, auto_delete=False)
        tag = None
        try:
            h.submit("a")
            assert [w for _, w in h.sent] == ["w0"]
            assert recovery.check(h.clock.now) == ["w0"]  # busy, its queue unconsumed: taken back
            assert recovery.routable(h.workers) == []
            fleet.beat(h.workers[0])  # its heartbeat goes on
            assert recovery.check(h.clock.now) == [] and recovery.routable(h.workers) == []
            tag = channel.basic_consume(h.workers[0].queue, callback=lambda message: None)  # its consumer is back
            assert recovery.check(h.clock.now) == [] and recovery.routable(h.workers) == h.workers
        finally:
            if tag is not None:
                channel.basic_cancel(tag)
            channel.queue_delete(h.workers[0].queue)
            channel.queue_delete(f"{ns}.recovery")
            client.delete(f"{ns}:fleet")


def test_a_worker_restarted_under_its_id_while_its_batches_are_taken_back_stays_in_the_fleet() -> None:
    """A worker stopped holding a batch of ours; by the time the check judged it lost (gone from the fleet view
    for half a staleness period) its replacement, under the same id, had beaten. The check used to remove that
    new heartbeat with the old worker's: the only worker of a model vanished from the API processes' view until
    its next beat (a rolling upgrade's calls to it answered 404). Real broker and Redis; the replacement beats
    while the batches are being taken back."""
    import uuid
    from dataclasses import replace

    import redis
    from kombu import Connection

    from harness.stack import BROKER_URL, REDIS_URL
    from tasks.broker.queues import recovery_queue
    from tasks.broker.recovery import Recovery
    from tasks.state.claims import Claims
    from tasks.state.fleet import Fleet
    from tasks.state.quarantine import Quarantine
    from tasks.state.results import ResultWriter

    ns = f"t{uuid.uuid4().hex[:10]}"
    h = Harness(size=1, workers=1)
    h.workers = [replace(worker("w0"), queue=f"{ns}.gpu.w0", heartbeat_at=h.clock.now)]
    client = redis.Redis.from_url(REDIS_URL)
    fleet = Fleet(client, f"{ns}:fleet", 3.0)
    beats: list[float] = []

    def connection() -> Connection:  # the replacement beats while the check takes the batches back
        if not beats:
            beats.append(h.clock.now)
            fleet.beat(replace(h.workers[0], heartbeat_at=h.clock.now))
        return Connection(BROKER_URL)

    recovery = Recovery(h.batcher, fleet, Claims(client, f"{ns}:claim"), Quarantine(client, f"{ns}:quarantine"),
                        ResultWriter(client, lambda i: i, 60), lambda event: None, connection,
                        recovery_queue(f"{ns}.recovery"))
    try:
        h.submit("a")
        assert [w for _, w in h.sent] == ["w0"]
        assert recovery.check(h.clock.now) == []  # gone from the view: not yet for long
        h.clock.advance(2.0)
        assert recovery.check(h.clock.now) == ["w0"] and beats, "taken back, the replacement beating meanwhile"
        assert h.batcher.held_by("w0") == []
        assert [w.heartbeat_at for w in fleet.all()] == beats, "the replacement's heartbeat is kept"
    finally:
        with Connection(BROKER_URL) as conn:
            conn.default_channel.queue_delete(f"{ns}.recovery")
        client.delete(f"{ns}:fleet")


def test_generation_requests_are_shared_by_tokens_and_corrected_by_what_they_took() -> None:
    """Two tenants, both backlogged: one sends 2,000-character prompts (about 500 tokens + 100 to generate),
    the other 40-character ones (10 + 100). A batch of 12 gives them equal estimated tokens, so the short
    tenant gets several times the requests; when the long tenant's answers turn out short, its refund buys it
    more of the next batch."""
    h = Harness(size=12, workers=1, max_outstanding=1)
    now = h.clock.now

    def send(rid: str, tenant: str, chars: int) -> None:
        request = InferenceRequest(id=rid, tenant=tenant, model="sim", items=(Item(f"{rid}.0", "x" * chars),),
                                   accepted_at=now, deadline=now + 30, reply_to="r",
                                   params=SamplingParams(max_tokens=100))
        h.record(h.batcher.add(request, lambda: None))

    h.batcher.scheduler.sent("w0", "busy", h.clock.now)  # the worker is busy: requests accumulate
    for k in range(60):
        send(f"long{k}", "long", 2000)
        send(f"short{k}", "short", 40)
    h.finished("w0", "busy")
    first = h.sent[-1][0]
    count = Counter(i.tenant for i in first.items)
    assert count["short"] >= 4 * count["long"] >= 4, count

    tokens = {t: sum(600 if t == "long" else 110 for i in first.items if i.tenant == t) for t in count}
    took = {"long": count["long"] * 150, "short": tokens["short"]}  # the long answers stopped early
    h.finished("w0", first.id, 0.25, took)
    second = h.sent[-1][0]
    assert Counter(i.tenant for i in second.items)["long"] > count["long"], Counter(i.tenant for i in second.items)


def test_the_batchers_config_comes_from_its_settings() -> None:
    from tasks.config import Settings

    c = BatcherConfig.from_settings(Settings.of(max_batch_size=7, max_wait_ms=5, wait_mode="fixed",
                                                prefix_wait_ms=200, max_outstanding_batches=3))
    assert (c.policy.max_batch_size, c.policy.max_wait_s, c.max_outstanding) == (7, 0.005, 3)
    assert c.wait is not None and (c.wait.mode, c.wait.fixed_s) == ("fixed", 0.005)
    assert c.prefix_wait_s == pytest.approx(0.2) and c.prefix_routing
