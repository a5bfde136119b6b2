"""How long a batch may wait for more items: fixed, or adaptive to the measured load.

Pure objects with an injected ``now``. The adaptive rule, per model, each time the batcher asks:

- no device could start the batch now (every worker holds its quota): wait ``min_s``. The batch is held
  anyway and keeps filling while the devices are busy, so it should leave the moment a slot opens;
- a full batch is close (the measured arrival rate fills it within the stretch bound): wait for it, so a
  free device gets a full batch rather than a sliver. The bound is ``max_s`` and never more than
  ``batch_fraction`` of the measured batch time: waiting 50 ms for a 1 s model is cheap, for a 20 ms one not;
- otherwise (thin traffic: waiting would add a latency the caller feels and gain few items): ``min_s``.
  Throughput is not lost by leaving early: while the device runs a small batch the next one accumulates,
  and once arrivals approach capacity no device is free and batches fill on their own.

The fixed mode always waits ``fixed_s`` from the first item (the classic size-or-timeout batcher).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class ArrivalRate:
    """Items per second, exponentially weighted over about ``window_s`` seconds."""

    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self._rate = 0.0
        self._at: float | None = None

    def observe(self, n: int, now: float) -> None:
        if self._at is None:
            self._at = now
            self._rate = 0.0
        self._decay(now)
        self._rate += n / self.window_s

    def rate(self, now: float) -> float:
        if self._at is None:
            return 0.0
        self._decay(now)
        return self._rate

    def _decay(self, now: float) -> None:
        assert self._at is not None
        dt = max(0.0, now - self._at)
        if dt:
            self._rate *= math.exp(-dt / self.window_s)
            self._at = now


@dataclass(frozen=True)
class WaitPolicy:
    mode: str = "adaptive"  # or "fixed"
    fixed_s: float = 0.020
    min_s: float = 0.001
    max_s: float = 0.050
    batch_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.mode not in ("adaptive", "fixed"):
            raise ValueError(f"wait mode must be 'adaptive' or 'fixed', not {self.mode!r}")
        if not 0 <= self.min_s <= self.max_s:
            raise ValueError("need 0 <= min wait <= max wait")

    def stretch_limit_s(self, batch_s: float | None) -> float:
        """The longest wait worth paying for a fuller batch, given the measured batch time."""
        if batch_s is None or batch_s <= 0:
            return self.max_s
        return max(self.min_s, min(self.max_s, batch_s * self.batch_fraction))

    def wait_s(self, *, waiting: int, waited_s: float, max_batch: int, rate_per_s: float,
               batch_s: float | None, device_free: bool) -> float:
        """Seconds the oldest waiting item (which has waited ``waited_s``) may wait in all before its batch
        is flushed."""
        if self.mode == "fixed":
            return self.fixed_s
        if waiting >= max_batch or not device_free or rate_per_s <= 0:
            return self.min_s
        full_at = waited_s + (max_batch - waiting) / rate_per_s  # when the batch is full, at this rate
        if full_at <= self.stretch_limit_s(batch_s):
            return max(self.min_s, full_at)
        return self.min_s
