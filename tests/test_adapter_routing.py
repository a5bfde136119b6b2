"""Adapter-aware batching and routing (pure, fake clock): the Inference Extension's score, what was sent counting
until the heartbeats say, the batch's adapter cap under fair queueing, affinity, replication of a hot adapter
and loading a cold one where there is room; with no adapters, nothing changes."""
from __future__ import annotations

from dataclasses import replace

from tasks.policy.adapter_routing import LOADING, NONE, RESIDENT, ROOM, SENT_KEPT_S, AdapterIndex, assign
from tasks.policy.batcher import Batcher, BatcherConfig
from tasks.policy.fairness import FairBuffer
from tasks.policy.flush import FlushPolicy
from tasks.policy.prefixes import Option
from tasks.policy.scheduler_output import SchedulerOutput
from tasks.schema import Batch, InferenceRequest, Item, SamplingParams, WorkerInfo
from tests.fakes import FakeClock


def worker(wid: str, adapters: tuple[str, ...] = (), loading: tuple[str, ...] = (), capacity: int = 2,
           at: float = 1_000.0, outstanding: int = 0) -> WorkerInfo:
    return WorkerInfo(id=wid, queue=f"q.{wid}", model="lm", max_batch=100, state="idle", outstanding=outstanding,
                      completed=0, batch_started_at=None, batch_ms_estimate=0.0, heartbeat_at=at, kind="causal",
                      slots=4, kv_tokens=100_000, max_adapters=capacity, adapters=adapters,
                      adapters_loading=loading)


def test_the_score_is_the_inference_extensions() -> None:
    clock = FakeClock(start=1_000.0)
    index = AdapterIndex(clock)
    index.report(worker("resident", ("a",)))
    index.report(worker("room", ("b",)))
    index.report(worker("loading", ("b",), loading=("a",)))
    index.report(worker("full", ("b", "c")))
    index.report(worker("none", capacity=0))
    assert [index.score(w, "a") for w in ("resident", "room", "loading", "full", "none", "unknown")] == \
        [RESIDENT, ROOM, LOADING, NONE, NONE, NONE]
    assert (RESIDENT, ROOM, LOADING) == (1.0, 0.8, 0.6)


def test_what_was_sent_counts_as_resident_until_it_is_old_and_the_reports_say_otherwise() -> None:
    clock = FakeClock(start=1_000.0)
    index = AdapterIndex(clock)
    index.report(worker("w", ()))
    index.sent("w", ["a"])
    assert index.score("w", "a") == RESIDENT and index.score("w", "b") == ROOM
    index.sent("w", ["b"])
    assert index.score("w", "c") == NONE  # two held (sent) of two: no room
    clock.advance(1.0)
    index.report(worker("w", ("b",), at=clock.now))  # an older heartbeat than the send: the send still counts
    assert index.score("w", "a") == RESIDENT
    clock.advance(SENT_KEPT_S)
    index.report(worker("w", ("b",), at=clock.now))
    assert index.score("w", "a") == ROOM and index.score("w", "b") == RESIDENT
    index.report(worker("w", (), at=clock.now - 10))  # a stale report is ignored
    assert index.score("w", "b") == RESIDENT


def test_assign_weighs_the_adapter_against_load_and_leaves_base_items_alone() -> None:
    index = AdapterIndex(FakeClock(start=1_000.0))
    for w in (worker("w0", ("x", "y")), worker("w1", ("a",)), worker("w2", ())):
        index.report(w)

    def where(adapters: list[str | None], loads: list[float]) -> list[int]:
        options = [Option(f"w{i}", load) for i, load in enumerate(loads)]
        return assign(adapters, options, index, lambda i, j: 0.0, [0] * len(adapters))

    assert where(["a", None], [0.0, 0.25, 0.0]) == [1, 0]  # resident beats room within 30% of load
    assert where(["a"], [0.0, 0.4, 0.0]) == [2]  # too loaded: loaded where there is room (replicated)
    assert where(["c", "c"], [0.0, 0.1, 0.05]) == [2, 2]  # cold: the least loaded with room, and its next follows


def test_the_batch_holds_at_most_the_cap_of_distinct_adapters_and_the_rest_go_first_next() -> None:
    buffer: FairBuffer[tuple[str, str | None]] = FairBuffer(FlushPolicy(100, 0.0), adapter_of=lambda i: i[1],
                                                           max_adapters=2)
    items = [("t0", "a"), ("t0", "a"), ("t1", "b"), ("t2", "c"), ("t2", None), ("t3", None), ("t1", "b")]
    for i, (tenant, adapter) in enumerate(items):
        buffer.add((f"{i}", adapter), now=0.0, deadline=99.0, tenant=tenant)
    first = [w.item for w in buffer.take()]
    assert {a for _, a in first} - {None} == {"a", "b"} and ("3", "c") not in first
    assert ("5", None) in first  # other tenants go on filling the batch
    second = [w.item for w in buffer.take()]
    assert second[0] == ("3", "c")  # the tenant the cap held back goes first
    assert len(first) + len(second) == len(items)


def test_no_cap_and_no_adapters_take_as_before() -> None:
    for cap in (0, 2):
        buffer: FairBuffer[tuple[str, str | None]] = FairBuffer(FlushPolicy(100, 0.0), adapter_of=lambda i: i[1],
                                                               max_adapters=cap)
        for i in range(9):
            buffer.add((f"{i}", None if cap else f"a{i}"), now=0.0, deadline=99.0, tenant=f"t{i % 3}")
        assert len(buffer.take()) == 9


class Fleet:
    def __init__(self, workers: list[WorkerInfo], adapter_routing: bool = True, cap: int = 4) -> None:
        self.clock = FakeClock(start=1_000.0)
        self.workers = workers
        self.sent: list[tuple[Batch, str]] = []
        self.batcher = Batcher(BatcherConfig(FlushPolicy(100, 0.001), adapter_routing=adapter_routing,
                                             max_adapters_per_batch=cap),
                               lambda: self.workers, clock=self.clock, wallclock=self.clock)

    def record(self, out: SchedulerOutput) -> None:
        self.sent += [(s.batch, s.worker.id) for s in out.sends]

    def call(self, rid: str, adapter: str | None, tenant: str = "t") -> None:
        now = self.clock.now
        params = SamplingParams(max_tokens=16, adapter=adapter, adapter_path=f"/a/{adapter}" if adapter else None)
        self.record(self.batcher.add(InferenceRequest(id=rid, tenant=tenant, model="lm",
                                                      items=(Item(f"{rid}.0", f"hello {rid}"),), accepted_at=now,
                                                      deadline=now + 30, reply_to="r", params=params), lambda: None))
        self.clock.advance(0.002)
        self.record(self.batcher.poll())

    def finish_all(self) -> None:
        for batch, wid in self.sent:
            self.record(self.batcher.finished(wid, batch.id))

    def where(self, rid: str) -> str:
        return next(w for b, w in self.sent if any(i.request_id == rid for i in b.items))


def test_items_follow_the_worker_holding_their_adapter() -> None:
    fleet = Fleet([worker("w0", ("a",), capacity=4), worker("w1", ("b",), capacity=4),
                   worker("w2", ("c",), capacity=4)])
    for q in range(4):
        for adapter, home in (("c", "w2"), ("a", "w0"), ("b", "w1")):
            fleet.call(f"{adapter}{q}", adapter)
            assert fleet.where(f"{adapter}{q}") == home
        fleet.finish_all()
    fleet.call("cold", "d")  # no one holds it: loaded where there is room, and its next calls follow it
    fleet.finish_all()
    home = fleet.where("cold")
    fleet.call("cold2", "d")
    assert fleet.where("cold2") == home


def test_a_hot_adapter_is_replicated_when_its_workers_are_full() -> None:
    fleet = Fleet([worker("w0", ("hot",), capacity=4, outstanding=0), worker("w1", (), capacity=4)])
    for q in range(12):  # never finished: w0 fills its outstanding limit, then the rest load it on w1
        fleet.call(f"h{q}", "hot")
    assert fleet.where("h0") == "w0" and {w for _, w in fleet.sent} == {"w0", "w1"}
    assert "hot" in fleet.batcher.router.adapters.held("w1")


def test_adapter_blind_routing_ignores_the_adapters() -> None:
    fleet = Fleet([worker("w0", ("a",), capacity=4), worker("w1", (), capacity=4), worker("w2", (), capacity=4)],
                  adapter_routing=False)
    for q in range(6):
        fleet.call(f"a{q}", "a")
    assert len({w for _, w in fleet.sent}) == 3  # least backlog spreads them


def test_the_batchers_batches_hold_at_most_the_cap_of_adapters() -> None:
    adapters_per_batch = {}
    for cap in (0, 2):
        fleet = Fleet([worker("w0", capacity=16)], cap=cap)
        now = fleet.clock.now
        for q in range(12):  # arrive together: one flush forms the batches
            params = SamplingParams(max_tokens=16, adapter=f"a{q % 4}")
            fleet.batcher.add(InferenceRequest(id=f"r{q}", tenant=f"t{q % 3}", model="lm",
                                               items=(Item(f"r{q}.0", "hi"),), accepted_at=now, deadline=now + 30,
                                               reply_to="r", params=params), lambda: None)
        fleet.clock.advance(0.01)
        fleet.record(fleet.batcher.poll())
        for _ in range(6):
            fleet.finish_all()
        assert sorted(i.request_id for b, _ in fleet.sent for i in b.items) == sorted(f"r{q}" for q in range(12))
        adapters_per_batch[cap] = [len({i.params.adapter for i in b.items}) for b, _ in fleet.sent]
    assert adapters_per_batch[0] == [4] and max(adapters_per_batch[2]) == 2


def test_an_item_waits_a_while_for_the_busy_worker_holding_its_adapter_rather_than_evict_elsewhere() -> None:
    fleet = Fleet([worker("w0", ("a",), capacity=1), worker("w1", ("b",), capacity=1)])
    for q in range(5):  # w0's outstanding limit (2 + 4 slots - 1): it cannot take another batch
        fleet.call(f"a{q}", "a")
    assert {fleet.where(f"a{q}") for q in range(5)} == {"w0"}
    fleet.call("waits", "a")  # w1 is full with b: loading a there would evict b
    assert not any(i.request_id == "waits" for b, _ in fleet.sent for i in b.items)
    fleet.call("b0", "b", tenant="other")  # other tenants' items do not wait
    assert fleet.where("b0") == "w1"
    first = fleet.sent[0][0]
    fleet.record(fleet.batcher.finished("w0", first.id))  # w0 frees a slot: the item goes there
    assert fleet.where("waits") == "w0"
    fleet.call("gives-up", "a")
    fleet.clock.advance(1.5)  # LLMB_PREFIX_WAIT_MS (1 s) passed: it goes where a worker can take it
    fleet.record(fleet.batcher.poll())
    assert fleet.where("gives-up") == "w1"


def test_metrics_per_worker_adapters_and_per_adapter_traffic_capped_with_other() -> None:
    from tasks.state.metrics import MAX_ADAPTER_LABELS, _adapters

    w = replace(worker("w0", ("a", "b"), loading=("c",), capacity=4), adapter_loads=7, adapter_evictions=3)
    items = {f"x{i}": i + 1 for i in range(MAX_ADAPTER_LABELS + 5)}
    families = {m.name: m for m in _adapters([w], items)}
    value = {name: {tuple(s.labels.values()): s.value for s in m.samples} for name, m in families.items()}
    assert value["llmb_worker_adapters_resident"][("w0", "lm")] == 2
    assert value["llmb_worker_adapters_loading"][("w0", "lm")] == 1
    assert value["llmb_worker_adapter_loads"][("w0", "lm")] == 7
    assert value["llmb_worker_adapter_evictions"][("w0", "lm")] == 3
    traffic = value["llmb_adapter_items"]
    assert len(traffic) == MAX_ADAPTER_LABELS + 1 and traffic[("other",)] == sum(range(1, 6))
    assert traffic[(f"x{MAX_ADAPTER_LABELS + 4}",)] == MAX_ADAPTER_LABELS + 5


def test_a_replica_still_loading_scores_below_the_workers_that_report_the_adapter() -> None:
    index = AdapterIndex(FakeClock(start=1_000.0))
    index.report(worker("w0", ("hot",), capacity=4))
    index.report(worker("w1", (), capacity=4))
    index.sent("w1", ["hot", "cold"])
    assert index.score("w1", "hot") == LOADING and index.score("w0", "hot") == RESIDENT
    assert index.score("w1", "cold") == RESIDENT  # no one else has it: its next calls follow it
    options = [Option("w1", 0.0), Option("w0", 0.1)]
    assert assign(["hot"], options, index, lambda i, j: 0.0, [0]) == [1]
