"""Recovery decisions as a pure function: split, isolate, retry, give up."""
from __future__ import annotations

import itertools

from tasks.isolation import plan
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


def test_a_worker_death_while_running_is_treated_like_a_raise() -> None:
    p = plan(batch(3), Failure.DIED, now=1.0)
    assert [len(b.items) for b in p.batches] == [2, 1]


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
