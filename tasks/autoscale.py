"""The autoscaling signal: per model, how old its oldest waiting request is and how many workers it needs.

The age of the oldest admitted, unanswered request is the signal to scale on (queue depth alone says nothing
about whether callers are waiting too long: 1,000 queued items are fine for a fleet that runs them in one
second and not for one that needs a minute). The recommended worker count is the steady-state answer:
arrival rate x batch time / batch size, times a headroom factor, rounded up. Both are exported on /metrics
(``llmb_oldest_queued_seconds``, ``llmb_recommended_workers``) and by ``llmb-admin stats``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tasks.admission import Admission
from tasks.config import Settings
from tasks.fleet import WorkerInfo


def recommended_workers(rate_per_s: float, workers: Sequence[WorkerInfo], headroom: float) -> int | None:
    """Workers a model needs for its arrival rate: rate x batch time / batch size x headroom, rounded up.

    Batch time and size are the live workers' own (measured EMA and advertised maximum); None when no worker
    has measured a batch yet. At least one while requests arrive; zero when none do (scale to zero is the
    operator's choice: KEDA's ``minReplicaCount``).
    """
    timed = [w for w in workers if w.batch_ms_estimate > 0]
    if not timed:
        return None
    if rate_per_s <= 0:
        return 0
    per_worker = sum(w.max_batch / (w.batch_ms_estimate / 1000) for w in timed) / len(timed)  # items/s
    return max(1, math.ceil(rate_per_s / per_worker * headroom))


def model_report(settings: Settings, admission: Admission, workers: Sequence[WorkerInfo], now: float
                 ) -> list[dict[str, Any]]:
    """One row per model served by a live worker (reads Redis: one script call and one MGET per model)."""
    models = sorted({w.model for w in workers})
    load = admission.model_load(models, now)
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
            "recommended_workers": recommended_workers(load[model].rate_per_s, mine, settings.scale_headroom),
        })
    return rows
