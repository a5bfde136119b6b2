"""harness/stats.py's percentile, the one every benchmark and load report uses (bench/load.py, bench/llm.py, the
harness's LoadReport and pooled summary): known values, the ends, and what it answers for no values."""
from __future__ import annotations

import collections
import math

import pytest

from harness.loadgen import LoadReport
from harness.pooled import quantile_s
from harness.stats import percentile, rounded


@pytest.mark.parametrize(("q", "expected"), [(0, 1), (10, 2), (49, 5), (50, 6), (90, 10), (99, 10), (100, 10)])
def test_the_value_at_index_q_percent_of_n_of_the_sorted_values(q: float, expected: int) -> None:
    assert percentile([7, 3, 10, 1, 5, 9, 2, 8, 6, 4], q) == expected  # 1..10, shuffled: index int(q / 10)


def test_a_hundred_values() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1
    assert percentile(values, 50) == 51.0
    assert percentile(values, 99) == 100.0
    assert percentile(values, 99.9) == 100.0
    assert percentile(values, 1) == 2.0
    assert values[0] == 100.0  # the input is left as it was (sorted in a copy)


def test_the_ends_and_one_value() -> None:
    assert percentile([2.5, 0.5, 1.5], 0) == 0.5  # the smallest
    assert percentile([2.5, 0.5, 1.5], 100) == 2.5  # the largest, never past the end
    assert percentile([2.5, 0.5, 1.5], 50) == 1.5
    assert percentile([42.0], 0) == percentile([42.0], 50) == percentile([42.0], 100) == 42.0
    assert percentile([3, 3, 3, 1], 50) == 3  # ties count once each


def test_no_values_is_none_and_each_report_says_so_its_own_way() -> None:
    assert percentile([], 50) is None
    assert quantile_s([], 99) == 0.0  # the pooled summary's figure
    report = LoadReport(0, collections.Counter(), collections.Counter(), 0, 0, [])
    assert math.isnan(report.p(50))  # the load report's


def test_the_reports_use_it() -> None:
    latencies = [30.0, 10.0, 20.0, 40.0]
    report = LoadReport(4, collections.Counter({200: 4}), collections.Counter(), 0, 0, latencies)
    assert [report.p(q) for q in (0, 50, 99)] == [10.0, 30.0, 40.0]
    assert quantile_s([0.0004, 0.0016, 0.0025], 50) == 0.002  # rounded to the ms


def test_rounded_keeps_none() -> None:
    assert rounded(None) is None
    assert rounded(1.26) == 1.3
    assert rounded(1.23456, 2) == 1.23
    assert rounded(1234.5678, 0) == 1235.0


def test_the_services_own_refusal_times_between_two_scrapes() -> None:
    """harness/refusal_times.py: the 429s between two scrapes of the cumulative buckets, their share within 20 ms
    and 1 s of arrival, and the bucket their p99 falls under."""
    from harness.refusal_times import refusals_since

    inf = float("inf")
    before = {0.005: 10.0, 0.02: 10.0, 0.5: 10.0, 1.0: 10.0, inf: 10.0}
    after = {0.005: 60.0, 0.02: 90.0, 0.5: 108.0, 1.0: 109.0, inf: 110.0}  # 100 more: 80 within 20 ms, 99 in 1 s
    assert refusals_since(before, after) == {"count": 100, "within_20ms": 0.8, "within_1s": 0.99, "p99_under_s": 1.0}
    assert refusals_since(after, after) == {"count": 0, "within_20ms": None, "within_1s": None, "p99_under_s": None}
