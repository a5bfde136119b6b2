"""Fair batch formation: which waiting items go into the next batch when several tenants compete.

Plain objects with no I/O; every method that depends on time takes ``now``.

- :class:`DeficitRoundRobin` is weighted deficit round robin (Shreedhar & Varghese) over one FIFO per tenant.
  Each item has a cost: one unit for a black-box model (it runs N inputs in about the same time as one, so
  a batch slot is the resource being shared), its tokens for a generation model (prompt plus output:
  :mod:`tasks.policy.tokens`), so a tenant with 2,000-token prompts and one with 20-token prompts get the
  same token throughput, not the same number of requests (token fairness in the spirit of Sheng et al.,
  "Fairness in Serving Large Language Models", OSDI '24). Each visit adds ``quantum x weight`` to a tenant's
  deficit and takes its items while the deficit covers them; rounds in which nobody could send anything are
  skipped in one step, so the cost of choosing does not grow with the item costs. An estimate corrected
  when the item finished (:meth:`DeficitRoundRobin.charge`) moves the tenant's deficit by the difference. A
  tenant whose queue empties leaves the ring with its deficit reset, so idle tenants bank nothing and
  whoever has work gets the idle capacity (work-conserving).
- :class:`FairBuffer` is the batcher's per-model buffer: one DRR ring per priority class. A batch takes
  interactive items first and fills what is left with offline ones; interactive items are flushed after the
  (adaptive) wait, offline ones may wait ``offline_wait_s`` so that their batches fill.

Why a buffer and not per-tenant RabbitMQ queues: the batcher already drains the request queue into memory
with the messages unacknowledged until their batch is handed on, and its prefetch is at least the
admission cap, so every admitted request is in a batcher's buffer instead of behind a flood in the FIFO
queue. The fair choice then needs no dynamic queues, no per-tenant consumers and no broker-side state.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tasks.policy.flush import FlushPolicy
from tasks.schema import Priority

T = TypeVar("T")



@dataclass(frozen=True)
class Waiting(Generic[T]):
    """One buffered item, with what fairness needs to know about it."""

    item: T
    arrived: float
    deadline: float
    tenant: str = "default"
    priority: Priority = Priority.INTERACTIVE
    cost: float = 1.0  # its share of the device: 1, or its estimated tokens (tasks.policy.tokens)


@dataclass
class _Flow(Generic[T]):
    weight: float
    queue: deque[Waiting[T]] = field(default_factory=deque)
    deficit: float = 0.0


class DeficitRoundRobin(Generic[T]):
    """Weighted deficit round robin across tenants, each item charged its cost."""

    def __init__(self, quantum: int = 10) -> None:
        if quantum < 1:
            raise ValueError("quantum must be at least 1")
        self.quantum = quantum
        self._flows: dict[str, _Flow[T]] = {}
        self._ring: deque[str] = deque()  # tenants with waiting items, in visiting order
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Waiting[T]]:
        for flow in self._flows.values():
            yield from flow.queue

    def add(self, waiting: Waiting[T], weight: float = 1.0) -> None:
        flow = self._flows.get(waiting.tenant)
        if flow is None:
            flow = self._flows[waiting.tenant] = _Flow(weight=min(max(weight, 0.01), 1000.0))
            self._ring.append(waiting.tenant)  # a new tenant joins at the back of the round
        else:
            flow.weight = min(max(weight, 0.01), 1000.0)  # the latest request's weight wins (an operator changed it)
        flow.queue.append(waiting)
        self._len += 1

    def oldest_arrival(self) -> float | None:
        return min((f.queue[0].arrived for f in self._flows.values()), default=None)

    def take(self, n: int, room: Callable[[Waiting[T]], bool] | None = None,
             later: Callable[[Waiting[T]], bool] | None = None,
             skip: Callable[[Waiting[T]], bool] | None = None) -> list[Waiting[T]]:
        """Remove and return up to ``n`` items chosen by weighted DRR; stop early at the first item for which
        ``room`` says there is no room left (the batch is full by size in bytes).

        A tenant whose visit is cut short by a full batch stays at the head of the ring with the rest of its
        deficit, so the next batch resumes exactly where this one stopped: fairness holds across batches.

        A tenant whose head item ``later`` says is better sent in another batch (prefix-aware routing: its
        worker cannot take one now) sits this batch out: not visited, so neither credited nor charged, and
        first in the ring for the next batch (after a tenant this batch cut short, which resumes first).

        A tenant whose next item ``skip`` says cannot join this batch (one LoRA adapter too many for it: the
        batch's adapter cap) ends its visit there, keeping its deficit, and is first in the ring for the next
        batch with those ``later`` held back; the others go on filling the batch.
        """
        waiting = [name for name in self._ring if later(self._flows[name].queue[0])] if later is not None else []
        for name in waiting:
            self._ring.remove(name)
        out, cut_short, skipped = self._take(n, room, skip)
        front = [*skipped, *waiting]
        if cut_short:  # it is at the head with the rest of its deficit: it goes on first
            head = self._ring.popleft()
            self._ring.extendleft(reversed(front))
            self._ring.appendleft(head)
        else:
            self._ring.extendleft(reversed(front))
        return out

    def _take(self, n: int, room: Callable[[Waiting[T]], bool] | None,
              skip: Callable[[Waiting[T]], bool] | None = None) -> tuple[list[Waiting[T]], bool, list[str]]:
        """The DRR visits; also whether the batch ended mid-visit (full, or ``n`` reached), the tenant at the
        head of the ring keeping the credit to go on, and the tenants ``skip`` took out of the ring."""
        out: list[Waiting[T]] = []
        skipped: list[str] = []
        full = False
        idle_visits = 0  # visits in a row that sent nothing: a whole round of them means skip ahead
        while len(out) < n and self._ring:
            if idle_visits >= len(self._ring):
                self._skip_idle_rounds()
                idle_visits = 0
            name = self._ring[0]
            flow = self._flows[name]
            if skip is not None and skip(flow.queue[0]):  # not visited: neither credited nor charged
                skipped.append(self._ring.popleft())
                continue
            if flow.deficit < flow.queue[0].cost:
                flow.deficit += self.quantum * flow.weight
            taken = 0
            held = False
            while len(out) < n and flow.queue and flow.deficit >= flow.queue[0].cost:
                if skip is not None and skip(flow.queue[0]):
                    held = True
                    break
                if room is not None and not room(flow.queue[0]):
                    full = True
                    break
                waiting = flow.queue.popleft()
                flow.deficit -= waiting.cost
                out.append(waiting)
                taken += 1
            if full:
                break
            idle_visits = 0 if taken else idle_visits + 1
            if held:  # the rest of its visit waits for the next batch, its deficit kept
                skipped.append(self._ring.popleft())
            elif not flow.queue:
                self._ring.popleft()
                del self._flows[name]
            elif flow.deficit < flow.queue[0].cost:
                self._ring.rotate(-1)  # its quantum is spent: next tenant
        self._len -= len(out)
        head = self._flows[self._ring[0]] if self._ring else None
        return out, head is not None and head.deficit >= head.queue[0].cost, skipped

    def _skip_idle_rounds(self) -> None:
        """A whole round sent nothing (every head costs more than its tenant's deficit): credit every tenant
        the rounds until the first of them could send, all but the last of those rounds at once (the next
        visits add the last one), exactly as that many empty rounds of plain DRR would."""
        rounds = min(math.ceil((f.queue[0].cost - f.deficit) / (self.quantum * f.weight))
                     for f in (self._flows[name] for name in self._ring))
        if rounds > 1:
            for name in self._ring:
                flow = self._flows[name]
                flow.deficit += (rounds - 1) * self.quantum * flow.weight

    def charge(self, tenant: str, tokens: float) -> None:
        """Correct a tenant's deficit by what its finished items really cost beyond their estimate (negative:
        a refund). Only a tenant still waiting is charged: an idle one banks nothing, debt or credit."""
        flow = self._flows.get(tenant)
        if flow is not None:
            flow.deficit -= tokens

    def put_back(self, taken: list[Waiting[T]]) -> None:
        """Return items taken by :meth:`take` to the heads of their queues (the batch could not be sent)."""
        for w in reversed(taken):
            flow = self._flows.get(w.tenant)
            if flow is None:
                flow = self._flows[w.tenant] = _Flow(weight=1.0)
                self._ring.appendleft(w.tenant)
            flow.queue.appendleft(w)
            self._len += 1

    def remove_if(self, expired: float) -> list[Waiting[T]]:
        """Remove and return every item whose deadline is at or before ``expired``."""
        gone: list[Waiting[T]] = []
        for name in list(self._flows):
            flow = self._flows[name]
            if any(w.deadline <= expired for w in flow.queue):
                gone += [w for w in flow.queue if w.deadline <= expired]
                flow.queue = deque(w for w in flow.queue if w.deadline > expired)
                if not flow.queue:
                    del self._flows[name]
                    self._ring.remove(name)
        self._len -= len(gone)
        return gone


class FairBuffer(Generic[T]):
    """A model's waiting items: flush decision plus fair, priority-ordered batch formation."""

    def __init__(self, policy: FlushPolicy, *, quantum: int = 10, offline_wait_s: float = 0.5,
                 size_of: Callable[[T], int] = lambda item: 0,
                 adapter_of: Callable[[T], str | None] = lambda item: None, max_adapters: int = 0) -> None:
        self.policy = policy
        self.adapter_of = adapter_of  # an item's LoRA adapter (None: the base model)
        self.max_adapters = max_adapters  # distinct adapters in one batch at most (0: no cap)
        self.offline_wait_s = offline_wait_s
        self.size_of = size_of  # an item's size in a batch message, bytes (for policy.max_batch_bytes)
        self.bytes = 0
        self.classes: dict[Priority, DeficitRoundRobin[T]] = {p: DeficitRoundRobin(quantum) for p in Priority}
        self._min_deadline = float("inf")  # a lower bound: makes drop_expired O(1) when nothing expired

    def __len__(self) -> int:
        return sum(len(c) for c in self.classes.values())

    def __iter__(self) -> Iterator[Waiting[T]]:
        for c in self.classes.values():
            yield from c

    def add(self, item: T, *, now: float, deadline: float, tenant: str = "default", weight: float = 1.0,
            priority: Priority = Priority.INTERACTIVE, cost: float = 1.0) -> None:
        cls = priority if priority in self.classes else Priority.INTERACTIVE
        self.classes[cls].add(Waiting(item, now, deadline, tenant, cls, cost), weight)
        self._min_deadline = min(self._min_deadline, deadline)
        self.bytes += self.size_of(item)

    def drop_expired(self, now: float) -> list[T]:
        """Remove and return every item whose deadline is at or before ``now``."""
        if self._min_deadline > now:
            return []
        gone = [w.item for c in self.classes.values() for w in c.remove_if(now)]
        self._min_deadline = min((w.deadline for w in self), default=float("inf"))
        self.bytes -= sum(self.size_of(item) for item in gone)
        return gone

    def ready_at(self, wait_s: float | None = None) -> float | None:
        """When a batch becomes due on its own: the oldest interactive item's arrival plus ``wait_s``
        (default: the policy's fixed wait), or the oldest offline item's plus the offline wait; None if empty.
        A full batch is due at once (``-inf``)."""
        if len(self) >= self.policy.max_batch_size or 0 < self.policy.max_batch_bytes <= self.bytes:
            return float("-inf")
        wait = self.policy.max_wait_s if wait_s is None else wait_s
        times = []
        if (a := self.classes[Priority.INTERACTIVE].oldest_arrival()) is not None:
            times.append(a + wait)
        if (a := self.classes[Priority.OFFLINE].oldest_arrival()) is not None:
            times.append(a + self.offline_wait_s)
        return min(times, default=None)

    def is_ready(self, now: float, wait_s: float | None = None) -> bool:
        at = self.ready_at(wait_s)
        return at is not None and now >= at

    def seconds_until_ready(self, now: float, wait_s: float | None = None) -> float | None:
        at = self.ready_at(wait_s)
        return None if at is None else max(0.0, at - now)

    def take(self, token_limit: float | None = None,
             later: Callable[[Waiting[T]], bool] | None = None) -> list[Waiting[T]]:
        """The next batch: interactive items by DRR, then offline items by DRR in the space left, up to
        ``max_batch_size`` items, ``max_batch_bytes`` and ``token_limit`` (the KV room of the worker it goes
        to, counted in item costs); a batch holds at least one item, whatever its size. Tenants whose head item
        ``later`` holds back sit this batch out (:meth:`DeficitRoundRobin.take`): the batch may be empty. At most
        ``max_adapters`` distinct LoRA adapters go in one batch: a tenant whose next item is of a further one
        waits for the next batch, first in line (:meth:`DeficitRoundRobin.take`'s ``skip``)."""
        n, limit = self.policy.max_batch_size, self.policy.max_batch_bytes
        used = 0
        used_tokens = 0.0
        adapters: set[str] = set()
        cap = self.max_adapters

        def skip(w: Waiting[T]) -> bool:
            name = self.adapter_of(w.item)
            return name is not None and name not in adapters and len(adapters) >= cap

        def room(w: Waiting[T]) -> bool:
            nonlocal used, used_tokens
            size = self.size_of(w.item)
            if limit and used and used + size > limit:
                return False
            if token_limit is not None and used_tokens and used_tokens + w.cost > token_limit:
                return False
            used += size
            used_tokens += w.cost
            if cap and (name := self.adapter_of(w.item)) is not None:
                adapters.add(name)
            return True

        capped = skip if cap else None
        out = self.classes[Priority.INTERACTIVE].take(n, room, later, capped)
        if len(out) < n and (not limit or used < limit):
            out += self.classes[Priority.OFFLINE].take(n - len(out), room, later, capped)
        self.bytes -= used
        return out

    def put_back(self, taken: list[Waiting[T]]) -> None:
        for p in Priority:
            self.classes[p].put_back([w for w in taken if w.priority == p])
        self._min_deadline = min([self._min_deadline, *(w.deadline for w in taken)])
        self.bytes += sum(self.size_of(w.item) for w in taken)

    def charge(self, tenant: str, tokens: float) -> None:
        """Correct a tenant's share by what its finished items cost beyond their estimate (in each class it
        is waiting in)."""
        for c in self.classes.values():
            c.charge(tenant, tokens)

    def oldest_interactive(self) -> float | None:
        return self.classes[Priority.INTERACTIVE].oldest_arrival()

    def clear(self) -> list[T]:
        items = [w.item for w in self]
        for p in Priority:
            self.classes[p] = DeficitRoundRobin(self.classes[p].quantum)
        self._min_deadline = float("inf")
        self.bytes = 0
        return items
