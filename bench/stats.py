"""The one percentile of every benchmark and load report (bench/load.py, bench/llm.py, tests/harness/loadgen.py,
tests/harness/pooled.py), so that their figures mean the same thing. Standard library only: bench/load.py, run as
a script, imports it from its own folder."""
from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of ``values``: the value at index ``int(q / 100 * n)`` of the sorted values,
    the largest for q = 100; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def rounded(value: float | None, digits: int = 1) -> float | None:
    """``round(value, digits)``, None kept."""
    return None if value is None else round(value, digits)
