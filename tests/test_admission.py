"""The deadline-aware admission cap, as a pure function."""
from __future__ import annotations

from tasks.admission import deadline_cap
from tasks.fleet import WorkerInfo


def test_the_admission_cap_shrinks_to_what_the_fleet_can_answer_in_time() -> None:
    def w(batch_ms: float) -> WorkerInfo:
        return WorkerInfo(id="w", queue="q", model="sim", max_batch=100, state="idle", outstanding=0, completed=0,
                          batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)

    assert deadline_cap([], 5.0, 10_000) == 10_000  # nothing measured yet: the configured cap
    assert deadline_cap([w(0.0)], 5.0, 10_000) == 10_000
    assert deadline_cap([w(250.0)], 5.0, 10_000) == 2000  # 400 items/s for 5 s
    assert deadline_cap([w(250.0), w(500.0)], 2.0, 10_000) == 1200  # (400 + 200)/s for 2 s
    assert deadline_cap([w(250.0)], 0.1, 10_000) == 100  # never below one full batch per worker
    assert deadline_cap([w(250.0)], 300.0, 10_000) == 10_000  # never above the configured cap


def test_recommended_workers_follow_arrival_rate_batch_time_and_headroom() -> None:
    from tasks.autoscale import recommended_workers

    def w(batch_ms: float) -> WorkerInfo:
        return WorkerInfo(id="w", queue="q", model="sim", max_batch=100, state="idle", outstanding=0, completed=0,
                          batch_started_at=None, batch_ms_estimate=batch_ms, heartbeat_at=0.0)

    assert recommended_workers(100.0, [w(0.0)], 1.25) is None  # no batch measured yet: no basis
    assert recommended_workers(0.0, [w(250.0)], 1.25) == 0  # nothing arrives
    assert recommended_workers(1.0, [w(250.0)], 1.25) == 1  # anything arriving needs one
    assert recommended_workers(400.0, [w(250.0)], 1.0) == 1  # exactly one device's capacity
    assert recommended_workers(400.0, [w(250.0)], 1.25) == 2  # ... plus headroom
    assert recommended_workers(1000.0, [w(250.0), w(250.0)], 1.25) == 4  # 1000/s x 0.25 s / 100 x 1.25
