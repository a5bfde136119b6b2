"""Prefix-aware routing as pure policy: the keys of a prompt's start, the index of what each worker holds, the
assignment among the workers able to take a batch, and the batcher using them (fake clock, its decisions taken
as sent)."""
from __future__ import annotations

from dataclasses import replace

from tasks.policy.batcher import Batcher, BatcherConfig
from tasks.policy.flush import FlushPolicy
from tasks.policy.prefixes import (
    CHUNK_CHARS,
    LOAD_WEIGHT,
    MAX_CHUNKS,
    PREFIX_WEIGHT,
    SENT_KEPT_S,
    Option,
    PrefixIndex,
    assign,
    prefix_keys,
)
from tasks.policy.scheduler_output import SchedulerOutput
from tasks.schema import Batch, InferenceRequest, Item, SamplingParams, WorkerInfo
from tests.fakes import FakeClock

SYSTEM = {t: f"tenant {t} policy: " + "".join(chr(97 + (i * 7 + t) % 26) for i in range(3000)) for t in range(4)}


def test_keys_name_whole_leading_chunks_chained() -> None:
    a = prefix_keys(SYSTEM[0] + " question one")
    b = prefix_keys(SYSTEM[0] + " another question, longer")
    assert len(a) == len(SYSTEM[0] + " question one") // CHUNK_CHARS
    assert a == b  # the questions are within the last partial chunk: same start, same keys
    c = prefix_keys("x" + SYSTEM[0])
    assert not set(a) & set(c)  # the same text shifted: nothing shared (keys name the text from its start)
    d = prefix_keys(SYSTEM[0][:CHUNK_CHARS] + "different" * 200)
    assert d[0] == a[0] and d[1] != a[1] and not set(d[1:]) & set(a)  # chained: one change, later keys differ
    assert len(prefix_keys("y" * CHUNK_CHARS * (MAX_CHUNKS + 5))) == MAX_CHUNKS
    assert prefix_keys("short") == ()
    assert prefix_keys("\ud800" * CHUNK_CHARS)  # a lone surrogate does not raise


def test_the_index_takes_reports_and_what_was_sent_since() -> None:
    index = PrefixIndex()
    keys = prefix_keys(SYSTEM[1])
    assert not index.knows("w0") and index.match("w0", keys) == 0
    index.report("w0", [], at=100.0)
    assert index.knows("w0")
    index.sent("w0", [keys], at=101.0)
    assert index.match("w0", keys) == len(keys)
    index.report("w0", [], at=102.0)  # taken before the batch ran: what was sent lately still counts
    assert index.match("w0", keys) == len(keys)
    index.report("w0", [], at=101.0 + SENT_KEPT_S + 1)  # long after: the worker's word is final
    assert index.match("w0", keys) == 0
    index.report("w0", list(reversed(keys[:3])), at=110.0)
    assert index.match("w0", keys) == 3
    index.report("w0", [], at=109.0)  # older than the one in use: ignored
    assert index.match("w0", keys) == 3
    small = PrefixIndex(keys_per_worker=4)
    small.report("w", [], at=0.0)
    small.sent("w", [keys], at=1.0)
    assert small.match("w", keys) == 4  # the chain's tail is trimmed first: its head still matches


def test_an_item_goes_to_the_able_worker_holding_most_of_its_start_within_the_balance_slack() -> None:
    index = PrefixIndex()
    mine, other = prefix_keys(SYSTEM[0]), prefix_keys(SYSTEM[1])
    index.sent("w1", [mine[:3]], at=0.0)
    index.sent("w2", [mine], at=0.0)
    index.sent("w0", [other], at=0.0)
    options = [Option("w0", 0.0), Option("w1", 0.0), Option("w2", 0.0)]
    assert assign([mine, other, prefix_keys("no shared start " * 100)], options, index) == [2, 0, 0]
    assert assign([mine], options[:1], index) == [0]  # one able worker: nothing to choose
    index.sent("w3", [mine[:1]], at=0.0)
    assert assign([mine], [Option("w0", 0), Option("w3", 0)], index) == [0]  # one chunk is not worth a move
    # holding the whole start is worth PREFIX_WEIGHT / LOAD_WEIGHT of the capacity in extra load, no more
    worth = PREFIX_WEIGHT / LOAD_WEIGHT
    near = [Option("w0", 0.1), Option("w2", 0.1 + worth * 0.9)]
    assert assign([mine], near, index) == [1]
    far = [Option("w0", 0.1), Option("w2", 0.1 + worth * 1.1)]
    assert assign([mine], far, index) == [0]
    partly = [Option("w0", 0.0), Option("w1", 0.0), Option("w2", 0.4)]  # w1 holds 3 chunks of mine, w2 all
    assert assign([mine], partly, index) == [1 if 3 / len(mine) * PREFIX_WEIGHT > (1 - 0.4 * LOAD_WEIGHT) else 2]


def lm_worker(wid: str, prefixes: tuple[str, ...] = (), at: float = 1_000.0) -> WorkerInfo:
    return WorkerInfo(id=wid, queue=f"q.{wid}", model="lm", max_batch=100, state="idle", outstanding=0, completed=0,
                      batch_started_at=None, batch_ms_estimate=0.0, heartbeat_at=at, kind="causal", slots=4,
                      kv_tokens=100_000, prefix_caching=True, prefixes=prefixes)


class Fleet:
    def __init__(self, workers: list[WorkerInfo], prefix_wait_s: float = 1.0) -> None:
        self.clock = FakeClock(start=1_000.0)
        self.workers = workers
        self.sent: list[tuple[Batch, str]] = []
        self.batcher = Batcher(BatcherConfig(FlushPolicy(100, 0.001), prefix_wait_s=prefix_wait_s),
                               lambda: self.workers, clock=self.clock, wallclock=self.clock)

    def record(self, out: SchedulerOutput) -> SchedulerOutput:
        """Each batch the batcher decides to send, taken as sent."""
        self.sent += [(s.batch, s.worker.id) for s in out.sends]
        return out

    def chat(self, rid: str, tenant: int, question: str) -> None:
        now = self.clock.now
        self.record(self.batcher.add(InferenceRequest(id=rid, tenant=f"t{tenant}", model="lm",
                                                      items=(Item(f"{rid}.0", SYSTEM[tenant] + question),),
                                                      accepted_at=now, deadline=now + 30, reply_to="r",
                                                      params=SamplingParams(max_tokens=16)), lambda: None))
        self.clock.advance(0.002)
        self.record(self.batcher.poll())

    def finish_all(self) -> None:
        for batch, wid in self.sent:  # a batch sent meanwhile is finished too
            self.record(self.batcher.finished(wid, batch.id))

    def where(self, rid: str) -> str:
        return next(w for b, w in self.sent if any(i.request_id == rid for i in b.items))


def test_the_batcher_sends_a_tenants_later_calls_where_its_start_is_cached() -> None:
    fleet = Fleet([lm_worker(f"w{i}") for i in range(4)])
    for t in range(4):  # first calls: wherever the scheduler puts them (least backlog)
        fleet.chat(f"first{t}", t, "?")
    fleet.finish_all()
    home = {t: fleet.where(f"first{t}") for t in range(4)}
    for q in range(3):
        for t in reversed(range(4)):
            fleet.chat(f"q{q}t{t}", t, f" question {q}")
            assert fleet.where(f"q{q}t{t}") == home[t]
        fleet.finish_all()
    # the workers' reports replace the batcher's own record: a start a worker no longer holds is not routed to
    fleet.clock.advance(SENT_KEPT_S + 1)
    fleet.workers = [replace(w, prefixes=(), heartbeat_at=fleet.clock.now) for w in fleet.workers]
    fleet.batcher.router.index = PrefixIndex()  # a restarted batcher: it knows only the reports
    moved = fleet.workers[1].id
    fleet.workers[1] = replace(fleet.workers[1], prefixes=tuple(reversed(prefix_keys(SYSTEM[0]))))
    fleet.chat("after", 0, " one more")
    assert fleet.where("after") == moved


def test_workers_without_a_prefix_cache_are_routed_as_before() -> None:
    plain = [replace(lm_worker(f"w{i}"), prefix_caching=False) for i in range(3)]
    fleet = Fleet(plain)
    for q in range(6):
        fleet.chat(f"q{q}", 0, f" question {q}")
    assert len({w for _, w in fleet.sent}) == 3  # least backlog spreads them: no affinity
    assert not fleet.batcher.router.index.knows("w0")


def test_a_tenant_left_for_a_later_batch_is_neither_credited_nor_charged_and_goes_first_next() -> None:
    from tasks.policy.fairness import DeficitRoundRobin, Waiting

    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=1)
    for t in ("a", "b", "c"):
        for i in range(3):
            drr.add(Waiting(f"{t}{i}", 0.0, 100.0, tenant=t))
    first = drr.take(4, later=lambda w: w.tenant == "a")
    assert [w.item for w in first] == ["b0", "c0", "b1", "c1"]
    second = drr.take(3)
    assert [w.item for w in second] == ["a0", "b2", "c2"]  # a first, as if it had not been passed over
    assert [w.item for w in drr.take(5)] == ["a1", "a2"]
    assert [w.item for w in drr.take(5, later=lambda w: True)] == [] and len(drr) == 0


def test_an_item_waits_a_while_for_the_busy_worker_holding_its_start_then_goes_anywhere() -> None:
    fleet = Fleet([lm_worker("w0"), lm_worker("w1")], prefix_wait_s=0.2)
    fleet.chat("a-first", 0, "?")
    fleet.chat("b-first", 1, "?")
    home = {0: fleet.where("a-first"), 1: fleet.where("b-first")}
    assert home[0] != home[1]
    fleet.finish_all()
    limit = fleet.batcher.scheduler.max_outstanding + 4 - 1  # each worker holds at most this many batches
    for i in range(limit):  # tenant 0 keeps its worker busy to its limit
        fleet.chat(f"a{i}", 0, f" question {i}")
    assert {fleet.where(f"a{i}") for i in range(limit)} == {home[0]}
    fleet.chat("b-next", 1, " mine")  # tenant 1's worker is free: at once, there
    assert fleet.where("b-next") == home[1]
    fleet.chat("a-waits", 0, " one more")
    assert not any(i.request_id == "a-waits" for b, _ in fleet.sent for i in b.items)  # held for its worker
    done = next(b for b, _ in fleet.sent if any(i.request_id == "a0" for i in b.items))
    fleet.record(fleet.batcher.finished(home[0], done.id))  # a batch of its worker ends: it goes there
    assert fleet.where("a-waits") == home[0]
    fleet.chat("a-late", 0, " and another")  # its worker is at its limit again: waits, then goes anywhere
    assert not any(i.request_id == "a-late" for b, _ in fleet.sent for i in b.items)
    fleet.clock.advance(0.25)
    fleet.record(fleet.batcher.poll())
    assert fleet.where("a-late") == home[1]


def test_an_item_no_able_worker_holds_the_start_of_stays_with_the_schedulers_choice() -> None:
    index = PrefixIndex()
    index.sent("w1", [prefix_keys(SYSTEM[1])], at=0.0)
    loaded_first = [Option("w0", 0.5), Option("w1", 0.0)]  # the scheduler's order weighs more than load
    assert assign([prefix_keys(SYSTEM[0]), prefix_keys("short")], loaded_first, index) == [0, 0]
    assert index.home(prefix_keys(SYSTEM[0]), ["w0", "w1"]) == (None, 0)


def busy_home_fleet() -> tuple[Fleet, dict[int, str]]:
    """Two workers, tenant 0's start cached on one, which is then busy to its limit with tenant 0's calls."""
    fleet = Fleet([lm_worker("w0"), lm_worker("w1")], prefix_wait_s=0.2)
    fleet.chat("a-first", 0, "?")
    fleet.chat("b-first", 1, "?")
    home = {0: fleet.where("a-first"), 1: fleet.where("b-first")}
    fleet.finish_all()
    for i in range(fleet.batcher.scheduler.max_outstanding + 4 - 1):
        fleet.chat(f"a{i}", 0, f" question {i}")
    return fleet, home


def test_items_deferred_for_their_prefixs_worker_do_not_hold_back_other_tenants() -> None:
    fleet, home = busy_home_fleet()
    fleet.chat("a-waits", 0, " one more")
    assert "a-waits" in {i.request_id for b in fleet.batcher.buffers["lm"] for i in [b.item.item]}
    now = fleet.clock.now
    call = InferenceRequest(id="c", tenant="t3", model="lm", items=(Item("c.0", "hello"),), accepted_at=now,
                            deadline=now + 30, reply_to="r")
    delay = fleet.record(fleet.batcher.add(call, lambda: None)).next_poll_s
    assert delay is not None and delay <= fleet.batcher.wait.fixed_s  # a timer for its own wait, not the deferral's
    fleet.clock.advance(delay)
    fleet.record(fleet.batcher.poll())
    assert fleet.where("c") == home[1]  # the free worker, without waiting out tenant 0's deferral
    assert not any(i.request_id == "a-waits" for b, _ in fleet.sent for i in b.items)


def test_an_item_is_not_deferred_when_an_able_worker_holds_as_much_of_its_start() -> None:
    fleet, home = busy_home_fleet()
    other = "w1" if home[0] == "w0" else "w0"
    fleet.batcher.router.index.sent(other, [prefix_keys(SYSTEM[0])], at=fleet.clock.now)  # replicated there
    fleet.chat("a-next", 0, " again")
    assert fleet.where("a-next") == other


def test_a_tenant_cut_short_by_a_full_batch_resumes_before_tenants_that_sat_it_out() -> None:
    from tasks.policy.fairness import DeficitRoundRobin, Waiting

    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=3)
    for t in ("a", "b"):
        for i in range(3):
            drr.add(Waiting(f"{t}{i}", 0.0, 100.0, tenant=t))
    assert [w.item for w in drr.take(2, later=lambda w: w.tenant == "a")] == ["b0", "b1"]  # b cut short
    assert [w.item for w in drr.take(2)] == ["b2", "a0"]  # b finishes its visit, then a
