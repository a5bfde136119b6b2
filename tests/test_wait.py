"""The adaptive wait policy and the arrival-rate meter, with a fake clock."""
from __future__ import annotations

import pytest

from tasks.policy.wait import ArrivalRate, WaitPolicy

ADAPTIVE = WaitPolicy("adaptive", fixed_s=0.020, min_s=0.001, max_s=0.050, batch_fraction=0.2)


def wait(**kw: object) -> float:
    args: dict = {"waiting": 1, "waited_s": 0.0, "max_batch": 100, "rate_per_s": 10.0, "batch_s": 1.0,
                  "device_free": True}
    args.update(kw)
    return ADAPTIVE.wait_s(**args)


def test_thin_traffic_and_a_free_device_leave_at_once() -> None:
    assert wait(rate_per_s=10.0) == 0.001  # a full batch is 10 s away: waiting gains nothing worth it


def test_busy_devices_or_a_full_batch_need_no_wait() -> None:
    assert wait(device_free=False, rate_per_s=5000.0) == 0.001
    assert wait(waiting=100, rate_per_s=5000.0) == 0.001


def test_wait_stretches_when_a_full_batch_is_close_and_a_device_is_free() -> None:
    assert wait(waiting=20, rate_per_s=2000.0) == pytest.approx(0.040)  # 80 more items in 40 ms
    assert wait(waiting=20, waited_s=0.005, rate_per_s=2000.0) == pytest.approx(0.045)  # counted from the first


def test_stretch_is_bounded_by_max_wait_and_by_batch_time() -> None:
    assert wait(waiting=1, rate_per_s=1500.0) == 0.001  # 66 ms to fill > 50 ms bound
    assert wait(waiting=20, rate_per_s=2000.0, batch_s=0.1) == 0.001  # 40 ms > a fifth of a 100 ms batch
    assert wait(waiting=20, rate_per_s=2000.0, batch_s=None) == pytest.approx(0.040)  # unknown: max_s bound


def test_fixed_mode_always_waits_the_same() -> None:
    fixed = WaitPolicy("fixed", fixed_s=0.020)
    for free in (True, False):
        assert fixed.wait_s(waiting=1, waited_s=0, max_batch=100, rate_per_s=0, batch_s=1, device_free=free) == 0.02


def test_bad_modes_and_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="wait mode must be 'adaptive' or 'fixed'"):
        WaitPolicy("sometimes")
    with pytest.raises(ValueError, match="need 0 <= min wait <= max wait"):
        WaitPolicy(min_s=0.1, max_s=0.05)


def test_arrival_rate_follows_the_load_and_decays() -> None:
    meter = ArrivalRate(window_s=1.0)
    assert meter.rate(0.0) == 0.0
    t = 0.0
    for _ in range(5000):  # 1000 items/s for 5 s
        t += 0.001
        meter.observe(1, t)
    assert meter.rate(t) == pytest.approx(1000, rel=0.02)
    assert meter.rate(t + 5.0) < 10  # traffic stopped: the estimate falls away within a few windows
