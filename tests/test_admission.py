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
