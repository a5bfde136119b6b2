"""Recovery decisions as a pure function: split, isolate, retry, give up."""
from __future__ import annotations

import itertools

from tasks.policy.isolation import avoid, plan
from tasks.schema import Batch, BatchItem, Failure


def batch(n: int, retries: int = 0) -> Batch:
    items = tuple(BatchItem(id=f"i{k}", request_id=f"r{k}", input=f"text {k}", deadline=9e9, accepted_at=0.0,
                            reply_to="c", retries=retries) for k in range(n))
    return Batch(id="root", model="sim", items=items, created_at=0.0)


def ids() -> itertools.count[int]:
    return itertools.count()


def test_a_failed_batch_is_split_in_two_halves_that_point_to_it() -> None:
    counter = ids()
    p = plan(batch(100), Failure.RAISED, now=1.0, new_id=lambda: f"b{next(counter)}")
    assert [len(b.items) for b in p.batches] == [50, 50]
    assert all(b.parent_id == "root" and b.attempt == 1 for b in p.batches)
    assert {i.id for b in p.batches for i in b.items} == {f"i{k}" for k in range(100)}
    assert not p.poison and not p.exhausted


def test_a_batch_whose_worker_died_goes_again_whole_then_is_split_like_a_raise_if_it_dies_again() -> None:
    p = plan(batch(3), Failure.DIED, now=1.0, died_on="w0")
    assert [len(b.items) for b in p.batches] == [3]  # most deaths are nobody's fault: one re-run, no search
    again = plan(p.batches[0], Failure.DIED, now=2.0, died_on="w1")
    assert [len(b.items) for b in again.batches] == [2, 1]


def test_a_failing_batch_of_one_has_isolated_its_poison() -> None:
    p = plan(batch(1), Failure.RAISED, now=1.0)
    assert [i.id for i in p.poison] == ["i0"] and not p.batches


def test_binary_search_isolates_one_poison_in_at_most_log2_levels() -> None:
    """Replay the whole search: only batches holding the poison input fail."""
    pending, levels, runs = [batch(100)], 0, {f"i{k}": 0 for k in range(100)}
    poison: list[str] = []
    while pending:
        next_level = []
        for b in pending:
            for i in b.items:
                runs[i.id] += 1
            if any(i.id == "i37" for i in b.items):
                p = plan(b, Failure.RAISED, now=0.0)
                poison += [i.id for i in p.poison]
                next_level += p.batches
        pending, levels = next_level, levels + 1
    assert poison == ["i37"]
    assert levels <= 8  # 100 -> 50 -> 25 -> 13 -> 7 -> 4 -> 2 -> 1
    assert max(r for k, r in runs.items() if k != "i37") <= 7


def test_stranded_batches_go_again_whole_until_retries_run_out() -> None:
    p = plan(batch(4), Failure.STRANDED, now=1.0, max_retries=3)
    assert len(p.batches) == 1 and len(p.batches[0].items) == 4
    assert all(i.retries == 1 for i in p.batches[0].items)
    p = plan(batch(4, retries=3), Failure.STRANDED, now=1.0, max_retries=3)
    assert not p.batches and len(p.exhausted) == 4


def test_a_lone_item_whose_worker_died_runs_again_elsewhere_not_as_poison() -> None:
    p = plan(batch(1), Failure.DIED, now=1.0, died_on="gpu0@a")
    assert not p.poison and not p.exhausted
    assert [i.died_on for b in p.batches for i in b.items] == [("gpu0@a",)]
    assert avoid(p.batches[0]) == {"gpu0@a"}


def test_a_lone_item_that_died_on_two_different_workers_is_poison() -> None:
    again = plan(plan(batch(1), Failure.DIED, now=1.0, died_on="gpu0@a").batches[0], Failure.DIED, now=2.0,
                 died_on="gpu1@b")
    assert [i.id for i in again.poison] == ["i0"] and not again.batches


def test_deaths_on_one_worker_alone_never_quarantine_but_end_in_a_clear_failure() -> None:
    b, deaths = batch(1), 0
    while True:
        p = plan(b, Failure.DIED, now=1.0, died_on="gpu0@a", max_retries=3)
        deaths += 1
        assert not p.poison
        if p.exhausted:
            break
        b = p.batches[0]
    assert deaths == 4


def test_a_killer_input_is_isolated_across_workers_and_innocents_are_not_blamed() -> None:
    """Replay the search for an input that kills whichever worker runs it, over three workers in turn."""
    pending, workers, poison, n = [batch(100)], itertools.cycle(["w0", "w1", "w2"]), [], 0
    innocent_blamed = 0
    while pending:
        b = pending.pop(0)
        n += 1
        if not any(i.id == "i37" for i in b.items):
            innocent_blamed += sum(1 for i in b.items if len(set(i.died_on)) >= 2 and len(b.items) == 1)
            continue
        p = plan(b, Failure.DIED, now=0.0, died_on=next(workers))
        poison += [i.id for i in p.poison]
        pending += p.batches
    assert poison == ["i37"] and innocent_blamed == 0 and n < 30


def test_a_batch_handed_back_by_a_stopping_worker_goes_again_whole_uncharged() -> None:
    p = plan(batch(5), Failure.RETURNED, now=1.0)
    assert len(p.batches) == 1 and [i.retries for i in p.batches[0].items] == [0] * 5
