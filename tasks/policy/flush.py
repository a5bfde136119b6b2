"""Flush policy: when a buffer of waiting items becomes a batch.

A plain object with no I/O and no clock of its own: every method takes ``now`` (monotonic seconds), so the
policy is tested with a fake clock and the batcher around it stays thin.

A batch is ready when it holds ``max_batch_size`` items, or when its *oldest* item has waited ``max_wait_s``
(the timer starts at the first item, as in Ray Serve, not on a periodic tick). Items whose deadline has
passed are dropped before a batch is formed, so expired work never reaches a device.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


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


@dataclass(frozen=True)
class Pending(Generic[T]):
    item: T
    arrived: float
    deadline: float


class BatchBuffer(Generic[T]):
    """FIFO of items waiting for a batch, with the flush decision built in."""

    def __init__(self, policy: FlushPolicy) -> None:
        self.policy = policy
        self._queue: deque[Pending[T]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Pending[T]]:
        return iter(self._queue)

    def add(self, item: T, *, now: float, deadline: float) -> None:
        self._queue.append(Pending(item, now, deadline))

    def drop_expired(self, now: float) -> list[T]:
        """Remove and return every item whose deadline is at or before ``now``."""
        if not any(p.deadline <= now for p in self._queue):
            return []
        expired = [p.item for p in self._queue if p.deadline <= now]
        self._queue = deque(p for p in self._queue if p.deadline > now)
        return expired

    def oldest_arrival(self) -> float | None:
        return self._queue[0].arrived if self._queue else None

    def is_ready(self, now: float) -> bool:
        """True when a batch should be flushed now (full, or its first item has waited long enough)."""
        if not self._queue:
            return False
        if len(self._queue) >= self.policy.max_batch_size:
            return True
        return now >= self._queue[0].arrived + self.policy.max_wait_s

    def seconds_until_ready(self, now: float) -> float | None:
        """How long until :meth:`is_ready` turns true on its own; None for an empty buffer."""
        if not self._queue:
            return None
        if self.is_ready(now):
            return 0.0
        return self._queue[0].arrived + self.policy.max_wait_s - now

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self._queue), default=None)

    def take(self) -> list[Pending[T]]:
        """Remove and return the next batch: up to ``max_batch_size`` items in arrival order.

        Items left behind keep their own arrival times, so their wait is still counted from when they came.
        """
        n = min(len(self._queue), self.policy.max_batch_size)
        return [self._queue.popleft() for _ in range(n)]

    def put_back(self, pending: list[Pending[T]]) -> None:
        """Return a taken batch to the front, unchanged (used when it could not be handed on)."""
        self._queue.extendleft(reversed(pending))

    def clear(self) -> list[T]:
        items = [p.item for p in self._queue]
        self._queue.clear()
        return items
