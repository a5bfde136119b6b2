"""Each model's load, read from the admission sets: the autoscaling signals that ``/metrics``, the admin API and
``llmb-admin`` report (the age of the oldest waiting interactive request, the arrival rate, the workers it needs).

Read side only: nothing here admits or releases (the one script it runs purges expired members first, as every
admission script does, so an age never comes from an item nobody waits for).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tasks.policy.capacity import recommended_workers
from tasks.schema import WorkerInfo
from tasks.state import admission_scripts as scripts
from tasks.state.admission import Admission
from tasks.state.lua import positional

RATE_WINDOW_S = 10  # the arrival rate is the mean over this many whole seconds


@dataclass(frozen=True)
class ModelLoad:
    oldest_age_s: float
    rate_per_s: float


def model_load(admission: Admission, models: Sequence[str], now: float) -> dict[str, ModelLoad]:
    """Per model: age of the oldest unanswered interactive request (offline ones are meant to wait) and the
    arrival rate (items/s, both classes) of the last seconds."""
    client = admission.client
    oldest_of = client.register_script(scripts.OLDEST)
    out: dict[str, ModelLoad] = {}
    second = int(now)
    for model in models:
        base = admission.model_key(model)
        oldest = oldest_of(keys=positional(scripts.OldestKeys(base, base + ":arrivals")))
        counts = client.mget([admission.rate_key(model, second - k) for k in range(1, RATE_WINDOW_S + 1)])
        rate = sum(int(c or 0) for c in counts) / RATE_WINDOW_S
        out[model] = ModelLoad(oldest_age_s=max(0.0, now - float(oldest)) if oldest else 0.0, rate_per_s=rate)
    return out


def model_report(admission: Admission, workers: Sequence[WorkerInfo], now: float, headroom: float
                 ) -> list[dict[str, Any]]:
    """One row per model served by a live worker (reads Redis: one script call and one MGET per model)."""
    models = sorted({w.model for w in workers})
    load = model_load(admission, models, now)
    rows = []
    for model in models:
        mine = [w for w in workers if w.model == model]
        timed = [w.batch_ms_estimate for w in mine if w.batch_ms_estimate > 0]
        rows.append({
            "model": model,
            "workers": len(mine),
            "oldest_queued_s": round(load[model].oldest_age_s, 3),
            "arrival_rate_per_s": round(load[model].rate_per_s, 2),
            "batch_ms": round(sum(timed) / len(timed), 1) if timed else None,
            "recommended_workers": recommended_workers(load[model].rate_per_s, mine, headroom),
        })
    return rows
