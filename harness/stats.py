"""The one percentile of every benchmark, load report and test that states one (bench/, harness/loadgen.py,
harness/pooled.py, tests/), so that their figures mean the same thing. Here, not in bench/, because tests import
the harness and never bench/. Standard library only: bench/load.py's load generator imports it."""
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
