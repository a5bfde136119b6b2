"""Flush policy: when a buffer of waiting items becomes a batch.

A plain value with no I/O and no clock of its own; the buffer that applies it is
:class:`tasks.policy.fairness.FairBuffer`, whose methods take ``now`` (monotonic seconds), so the rule is
tested with a fake clock (tests/test_flush.py) and the batcher around it stays thin.

A batch is ready when it holds ``max_batch_size`` items, or when its *oldest* item has waited ``max_wait_s``
(the timer starts at the first item, as in Ray Serve, not on a periodic tick). Items whose deadline has
passed are dropped before a batch is formed, so expired work never reaches a device.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlushPolicy:
    max_batch_size: int = 100
    max_wait_s: float = 0.020
    max_batch_bytes: int = 0  # a batch also ends when its inputs reach this many bytes (0: no limit)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must not be negative")
