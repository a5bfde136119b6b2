"""What the batcher decided, as data: the batches to publish to which worker's queue, the items dropped and why,
and the request messages each step lets the consumer acknowledge (vLLM's scheduler returns a ``SchedulerOutput``
the same way; its engine carries it out).

The batcher (:mod:`tasks.policy.batcher`) does no I/O: its consumer (:mod:`tasks.broker.consumer`) publishes
each :class:`Send` in order and records each :class:`Drop`, then acknowledges the messages of the steps done, so
a message is acknowledged only when every one of its items has been handed on or dropped. A send the broker
refuses goes back to the batcher (``Batcher.unsent``) with the steps after it, and nothing that depended on it
is acknowledged.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from tasks.policy.fairness import Waiting
from tasks.schema import Batch, BatchItem, WorkerInfo


@dataclass(eq=False)
class Delivery:
    """One request (or recovery) message: to acknowledge once its last item (or batch) is resolved."""

    ack: Callable[[], None]
    remaining: int

    def resolve(self) -> bool:
        """One of its items is handed on or dropped; True when that was its last."""
        self.remaining -= 1
        return self.remaining == 0


def resolve(deliveries: Iterable[Delivery]) -> tuple[Delivery, ...]:
    """Resolve one item per entry (a message with two items here is resolved twice); those now complete."""
    return tuple(d for d in deliveries if d.resolve())


@dataclass(frozen=True)
class Entry:
    """A buffered item and the message it came in."""

    item: BatchItem
    delivery: Delivery = field(compare=False)


@dataclass(frozen=True)
class Send:
    """Publish ``batch`` to ``worker``'s queue; once the broker confirms it, acknowledge ``acks``."""

    batch: Batch
    worker: WorkerInfo
    acks: tuple[Delivery, ...] = ()
    # Where it came from, to put it back if it cannot be published: the buffered items it was formed of, or the
    # recovery message of a batch sent again.
    taken: tuple[Waiting[Entry], ...] = field(default=(), repr=False, compare=False)
    retry_of: Delivery | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Drop:
    """``items`` of ``model`` will not run: record them (``status``, as the ledger names it, and ``reason``),
    then acknowledge ``acks``."""

    model: str
    items: tuple[BatchItem, ...]
    status: str
    reason: str
    acks: tuple[Delivery, ...] = ()


Step = Send | Drop


@dataclass(frozen=True)
class SchedulerOutput:
    """The batcher's decisions from one call: acknowledge ``acks`` (messages with nothing left to resolve), carry
    out ``steps`` in order, and call ``Batcher.poll`` again in ``next_poll_s`` (None: on the next event)."""

    steps: tuple[Step, ...] = ()
    next_poll_s: float | None = None
    acks: tuple[Delivery, ...] = ()

    @property
    def sends(self) -> list[Send]:
        return [s for s in self.steps if isinstance(s, Send)]

    @property
    def drops(self) -> list[Drop]:
        return [s for s in self.steps if isinstance(s, Drop)]

    @staticmethod
    def join(outputs: Sequence[SchedulerOutput]) -> SchedulerOutput:
        """Several calls' decisions as one: their steps in order, the soonest poll."""
        delays = [o.next_poll_s for o in outputs if o.next_poll_s is not None]
        return SchedulerOutput(tuple(s for o in outputs for s in o.steps), min(delays, default=None),
                               tuple(a for o in outputs for a in o.acks))
