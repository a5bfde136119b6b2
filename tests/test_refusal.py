"""The gateway's refusal rules (tasks/policy/refusal.py), pure: no Redis, no broker, an injected ``now``."""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from tasks.errors import (
    BatchingError,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    Overloaded,
    PoisonInput,
    QueueFull,
    RetriesExhausted,
    TenantOverLimit,
    Unavailable,
)
from tasks.policy.refusal import (
    AdmissionVerdict,
    FullVerdictCache,
    admission_refusal,
    deadline_refusal,
    error_of,
    shortest_answer_s,
    token_demand,
)
from tasks.schema import NO_PARAMS, ItemResult, Priority, SamplingParams, WorkerInfo


def worker(model: str = "m", batch_ms: float = 0.0, max_batch: int = 8, kv_tokens: int = 0,
           max_context: int = 0) -> WorkerInfo:
    return WorkerInfo(id=f"w-{model}", queue="q", model=model, max_batch=max_batch, state="idle", outstanding=0,
                      completed=0, batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0,
                      kv_tokens=kv_tokens, max_context=max_context)


def refuse(verdict: str, bad_hash: str | None = None, ahead: int = 0, *, tenant_cap: int | None = None,
           hashes: Sequence[str] = ("h0",), workers: Sequence[WorkerInfo] = ()) -> BatchingError | None:
    return admission_refusal(verdict, bad_hash, ahead, model="m", tenant="acme", tenant_cap=tenant_cap,
                             hashes=hashes, workers=workers, admission_cap=100, retry_floor_s=2)


def test_an_admitted_call_is_not_refused_and_a_late_admission_is_503() -> None:
    assert refuse(AdmissionVerdict.OK) is None
    late = refuse(AdmissionVerdict.LATE)
    assert isinstance(late, Unavailable) and "too late" in late.message


def test_a_quarantined_input_is_named_by_its_index_and_hash() -> None:
    error = refuse(AdmissionVerdict.QUARANTINED, bad_hash="bad", hashes=("ok", "bad"))
    assert isinstance(error, PoisonInput)
    assert "input 1 is quarantined (hash bad)" in error.message and "quarantine release bad" in error.message


def test_a_tenant_at_its_cap_is_told_its_cap_and_when_to_come_back() -> None:
    fast = worker(batch_ms=1000, max_batch=10)  # 10 items/s
    error = refuse(AdmissionVerdict.TENANT_FULL, ahead=35, tenant_cap=7, workers=[fast, worker("other", 1000, 1)])
    assert isinstance(error, TenantOverLimit) and "cap of 7 items" in error.message
    assert error.retry_after_s == 4  # 35 items ahead at 10/s, rounded up; the other model's worker not counted
    default = refuse(AdmissionVerdict.TENANT_FULL, ahead=0, workers=[fast])
    assert isinstance(default, TenantOverLimit) and "cap of 100 items" in default.message
    assert default.retry_after_s == 2  # the floor


def test_a_full_model_is_429_with_retry_after_from_the_work_ahead() -> None:
    tokens = refuse(AdmissionVerdict.TOKENS_FULL, ahead=5000)
    assert isinstance(tokens, QueueFull) and "5000 tokens" in tokens.message and tokens.retry_after_s == 2
    full = refuse(AdmissionVerdict.FULL, ahead=100, workers=[worker(batch_ms=500, max_batch=10)])  # 20 items/s
    assert isinstance(full, QueueFull) and "the service is full" in full.message and full.retry_after_s == 5
    unmeasured = refuse(AdmissionVerdict.FULL, ahead=100)
    assert isinstance(unmeasured, QueueFull) and unmeasured.retry_after_s == 2  # nothing measured: the floor


def test_the_shortest_answer_is_one_batch_on_the_fastest_measured_worker() -> None:
    assert shortest_answer_s([]) == 0.0
    assert shortest_answer_s([worker(batch_ms=0)]) == 0.0
    assert shortest_answer_s([worker(batch_ms=0), worker(batch_ms=300), worker(batch_ms=120)]) == pytest.approx(0.12)


def test_a_call_that_could_only_be_answered_late_is_refused() -> None:
    never = deadline_refusal("m", 100, remaining_s=0.1, waited_s=0.0, shortest_s=0.25, retry_floor_s=3)
    assert isinstance(never, DeadlineExceeded) and "100 ms is shorter than one batch" in never.message
    waited = deadline_refusal("m", 1000, remaining_s=0.2, waited_s=0.8, shortest_s=0.25, retry_floor_s=3)
    assert isinstance(waited, Overloaded) and "took 800 ms" in waited.message and waited.retry_after_s == 3
    assert deadline_refusal("m", 1000, remaining_s=0.3, waited_s=0.7, shortest_s=0.25, retry_floor_s=3) is None
    assert deadline_refusal("m", 1, remaining_s=0.001, waited_s=0.0, shortest_s=0.0, retry_floor_s=3) is None


def test_token_demand_reads_the_workers_only_for_generation_and_refuses_what_never_fits() -> None:
    asked: list[bool] = []

    def workers() -> list[WorkerInfo]:
        asked.append(True)
        return [worker(kv_tokens=1000, max_context=500), worker(kv_tokens=3000, max_context=600)]

    assert token_demand(["hi", "there"], NO_PARAMS, "m", workers, 4.0) == ([], 0) and not asked
    fifty = SamplingParams(max_tokens=50)
    estimates, budget = token_demand(["a" * 40, "b"], fifty, "m", workers, 2.0)
    assert estimates == [60, 51] and budget == 8000 and asked  # 10 + 50 and 1 + 50; (1000 + 3000) x 2
    assert token_demand(["a" * 40], fifty, "m", lambda: None, 2.0) == ([60], 0)  # fleet unread
    with pytest.raises(InvalidInput, match="input 1 needs at least 601 tokens"):
        # 1 + 599 fits 600; 2 + 599 not
        token_demand(["x", "y" * 17], SamplingParams(max_tokens=599), "m", workers, 1.0)


@pytest.mark.parametrize(("kind", "error"), [
    ("invalid_request", InvalidInput), ("poison_input", PoisonInput), ("retries_exhausted", RetriesExhausted),
    ("inference_failed", InferenceFailed), ("something_new", InferenceFailed), (None, InferenceFailed),
])
def test_an_items_error_becomes_the_callers(kind: str | None, error: type) -> None:
    found = error_of(ItemResult(error=kind, message="why"))
    assert type(found) is error and found.message == "why"
    assert error_of(ItemResult(error=kind)).message == "the model failed on this input"


def test_a_full_verdict_is_held_for_its_model_and_class_while_fresh() -> None:
    held = FullVerdictCache(hold_s=0.5)
    assert held.held("m", Priority.INTERACTIVE, 10.0) is None and not held.any_fresh(10.0)
    held.hold("m", Priority.INTERACTIVE, QueueFull("full", retry_after_s=3), now=10.0)
    again = held.held("m", Priority.INTERACTIVE, 10.4)
    assert again is not None and again.message == "full" and again.retry_after_s == 3 and held.any_fresh(10.4)
    assert held.held("m", Priority.OFFLINE, 10.4) is None and held.held("n", Priority.INTERACTIVE, 10.4) is None
    assert held.held("m", Priority.INTERACTIVE, 10.5) is None and not held.any_fresh(10.5)


def test_a_flood_of_full_verdicts_keeps_at_most_max_held_the_fresh_ones_last() -> None:
    held = FullVerdictCache(hold_s=0.02, max_held=16)
    now = 10.0
    for i in range(10_000):
        held.hold(f"model-{i}", Priority.INTERACTIVE, QueueFull("full", retry_after_s=1), now)
        now += 0.001
    assert len(held.verdicts) <= 16, "bounded"
    assert held.held("model-9999", Priority.INTERACTIVE, now) is not None, "the newest verdict is held"
    held.hold("m", Priority.OFFLINE, QueueFull("full", retry_after_s=1), now + 1.0)
    assert list(held.verdicts) == [("m", Priority.OFFLINE)], "the expired went once the cache was full"
