"""Weighted deficit round robin and the fair, priority-ordered buffer, with a fake clock."""
from __future__ import annotations

from collections import Counter

from tasks.policy.fairness import DeficitRoundRobin, FairBuffer, Waiting
from tasks.policy.flush import FlushPolicy
from tasks.schema import Priority


def waiting(tenant: str, k: int, *, at: float = 0.0, deadline: float = 100.0,
            priority: Priority = Priority.INTERACTIVE) -> Waiting[str]:
    return Waiting(f"{tenant}{k}", at, deadline, tenant, priority)


def test_flood_cannot_fill_every_batch() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(5000):
        drr.add(waiting("a", k))
    for k in range(3):
        drr.add(waiting("b", k))
    batch = drr.take(100)
    assert len(batch) == 100
    assert [w.item for w in batch if w.tenant == "b"] == ["b0", "b1", "b2"]  # all of B's, in the first batch
    assert [w.item for w in batch if w.tenant == "a"][:3] == ["a0", "a1", "a2"]  # each tenant stays FIFO


def test_idle_capacity_goes_to_whoever_has_work() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(250):
        drr.add(waiting("a", k))
    assert len(drr.take(100)) == 100  # alone: full batches, no quantum limit
    assert len(drr.take(100)) == 100
    assert len(drr.take(100)) == 50
    assert len(drr) == 0 and drr.take(100) == []


def test_weights_share_batch_slots_when_both_are_backlogged() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(3000):
        drr.add(waiting("heavy", k), weight=3.0)
        drr.add(waiting("light", k), weight=1.0)
    counts = Counter(w.tenant for _ in range(10) for w in drr.take(100))
    assert counts["heavy"] == 750 and counts["light"] == 250


def test_fairness_carries_across_batches() -> None:
    """A visit cut short by a full batch resumes in the next one: small batches still share 1:1."""
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(200):
        drr.add(waiting("a", k))
        drr.add(waiting("b", k))
    counts = Counter(w.tenant for _ in range(20) for w in drr.take(7))
    assert abs(counts["a"] - counts["b"]) <= 10


def test_an_idle_tenant_banks_no_credit() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    drr.add(waiting("b", 0))
    drr.take(100)  # b leaves the ring when its queue empties
    for k in range(100):
        drr.add(waiting("a", k))
        drr.add(waiting("b", k + 1))
    counts = Counter(w.tenant for w in drr.take(40))
    assert counts == {"a": 20, "b": 20}


def test_put_back_restores_order() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(5):
        drr.add(waiting("a", k))
    taken = drr.take(3)
    drr.put_back(taken)
    assert [w.item for w in drr.take(10)] == ["a0", "a1", "a2", "a3", "a4"]


def test_interactive_goes_first_and_offline_fills_the_rest() -> None:
    buf: FairBuffer[str] = FairBuffer(FlushPolicy(10, 0.02), offline_wait_s=0.5)
    for k in range(8):
        buf.add(f"off{k}", now=0.0, deadline=100, tenant="batch-job", priority=Priority.OFFLINE)
    for k in range(4):
        buf.add(f"int{k}", now=0.01, deadline=100, tenant="chat")
    batch = [w.item for w in buf.take()]
    assert batch == ["int0", "int1", "int2", "int3", "off0", "off1", "off2", "off3", "off4", "off5"]


def test_offline_waits_longer_to_fill() -> None:
    buf: FairBuffer[str] = FairBuffer(FlushPolicy(100, 0.02), offline_wait_s=0.5)
    buf.add("off", now=0.0, deadline=100, priority=Priority.OFFLINE)
    assert not buf.is_ready(0.1)
    assert buf.seconds_until_ready(0.1) == 0.4
    buf.add("int", now=0.2, deadline=100)
    assert not buf.is_ready(0.21) and buf.is_ready(0.22)  # an interactive item brings the flush forward


def test_full_buffer_is_ready_at_once_and_wait_is_adjustable() -> None:
    buf: FairBuffer[str] = FairBuffer(FlushPolicy(3, 0.02))
    buf.add("x", now=0.0, deadline=100)
    assert buf.is_ready(0.005, wait_s=0.001) and not buf.is_ready(0.005)
    buf.add("y", now=0.0, deadline=100)
    buf.add("z", now=0.0, deadline=100)
    assert buf.is_ready(0.0)


def test_expired_items_are_dropped_from_every_tenant() -> None:
    buf: FairBuffer[str] = FairBuffer(FlushPolicy(100, 0.02))
    buf.add("a-late", now=0.0, deadline=1.0, tenant="a")
    buf.add("a-ok", now=0.0, deadline=9.0, tenant="a")
    buf.add("b-late", now=0.0, deadline=2.0, tenant="b", priority=Priority.OFFLINE)
    assert buf.drop_expired(0.5) == []
    assert sorted(buf.drop_expired(2.0)) == ["a-late", "b-late"]
    assert [w.item for w in buf.take()] == ["a-ok"]
    assert len(buf) == 0


def test_a_batch_ends_at_its_byte_limit_and_always_holds_one_item() -> None:
    """Big inputs: a batch must fit in one broker message, whatever the item count allows."""
    buffer: FairBuffer[str] = FairBuffer(FlushPolicy(100, 1.0, max_batch_bytes=1000), size_of=len)
    for k in range(5):
        buffer.add("a" * 400 + str(k), now=0.0, deadline=100.0, tenant="a")
    buffer.add("b" * 5000, now=0.0, deadline=100.0, tenant="b")
    assert buffer.is_ready(0.0)  # over the byte limit: due at once, like a full batch
    sizes = []
    while buffer:
        batch = buffer.take()
        assert batch and (sum(len(w.item) for w in batch) <= 1000 or len(batch) == 1)
        sizes.append(len(batch))
    assert sorted(sizes) == [1, 1, 2, 2] and buffer.bytes == 0


def test_the_byte_count_follows_drops_and_put_backs() -> None:
    buffer: FairBuffer[str] = FairBuffer(FlushPolicy(100, 1.0, max_batch_bytes=10_000), size_of=len)
    buffer.add("x" * 100, now=0.0, deadline=1.0)
    buffer.add("y" * 50, now=0.0, deadline=5.0)
    assert buffer.bytes == 150
    buffer.drop_expired(2.0)
    assert buffer.bytes == 50
    taken = buffer.take()
    assert buffer.bytes == 0
    buffer.put_back(taken)
    assert buffer.bytes == 50 and not buffer.is_ready(0.5)


# -- token fairness (generation models: an item costs its tokens) ---------------------------------------------
def costly(tenant: str, k: int, cost: float) -> Waiting[str]:
    return Waiting(f"{tenant}{k}", 0.0, 100.0, tenant, Priority.INTERACTIVE, cost)


def test_long_and_short_prompts_get_equal_token_throughput_not_equal_requests() -> None:
    """Both backlogged, equal weights: a tenant of 2,020-token requests and one of 40-token requests get the
    same tokens per batch (within one request's cost), so the short one sends about fifty times the requests."""
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(2000):
        drr.add(costly("long", k, 2020))
        drr.add(costly("short", k, 40))
    tokens: Counter[str] = Counter()
    for _ in range(20):
        for w in drr.take(100):
            tokens[w.tenant] += int(w.cost)
    assert abs(tokens["long"] - tokens["short"]) / tokens["short"] <= 0.10, tokens
    assert abs(tokens["long"] - tokens["short"]) <= 2020 + 10, tokens


def test_token_weights_share_tokens_in_proportion() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(5000):
        drr.add(costly("gold", k, 300), weight=3)
        drr.add(costly("free", k, 100), weight=1)
    tokens: Counter[str] = Counter()
    for _ in range(30):
        for w in drr.take(100):
            tokens[w.tenant] += int(w.cost)
    assert 2.7 <= tokens["gold"] / tokens["free"] <= 3.3, tokens


def test_a_refund_of_unused_tokens_is_spent_by_the_tenant_still_waiting() -> None:
    """Charged 1,000 tokens per request on its max_tokens, a tenant whose answers were short gets the unused
    tokens back as deficit, and sends more before the round moves on; a tenant with no waiting item banks
    nothing."""
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(50):
        drr.add(costly("a", k, 1000))
        drr.add(costly("b", k, 1000))
    first = drr.take(4)
    assert Counter(w.tenant for w in first) == {"a": 2, "b": 2}
    drr.charge("a", -1800)  # its two answers took 100 tokens each
    drr.charge("nobody", -10_000)  # not waiting: ignored
    nxt = [w.tenant for w in drr.take(6)]
    assert nxt.count("a") >= 3, nxt


def test_choosing_costs_no_more_with_expensive_items() -> None:
    """Rounds in which nobody can send are skipped in one step: 100 items of 100,000 tokens at a quantum of 10
    take a handful of passes, not 10,000 rounds each."""
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum=10)
    for k in range(100):
        drr.add(costly("a", k, 100_000))
        drr.add(costly("b", k, 99_000))
    got = drr.take(50)
    assert len(got) == 50 and abs(sum(w.tenant == "a" for w in got) - 25) <= 1


def test_black_box_items_stay_item_fair() -> None:
    """An item without a token count (embeddings, sim) costs one unit: batch slots are shared, as before."""
    from tasks.policy.tokens import cost
    from tasks.schema import NO_PARAMS, SamplingParams

    assert cost("a sentence to embed", NO_PARAMS) == 1.0
    assert cost("x" * 400, SamplingParams(max_tokens=16)) == 100 + 16
