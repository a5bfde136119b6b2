"""Which LoRA adapters one worker holds in its device memory (pure, with an injected clock).

A worker keeps at most ``capacity`` adapters resident (``LLMB_MAX_ADAPTERS``), as vLLM's ``max_cpu_loras`` and
Ray Serve's per-replica limit do. When a call needs one that is not resident, the least recently used adapter
that no running row uses and that is not pinned makes room (S-LoRA's and Ray Serve's LRU); pinned adapters (an
operator's "never evict": ``llmb-admin adapters add --pin``) stay. When every resident adapter is pinned or in
use, the load waits: the plan says so and the caller keeps the row waiting rather than evicting under a running
row. Loading itself happens off the decoding loop; this object only records it (``loading`` → ``loaded`` or
``failed``), so the heartbeat can report resident and loading adapters and the batchers route on them.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Plan:
    """What to do so that an adapter can serve a row: ``ready`` (resident now), else ``load`` it after evicting
    ``evict`` (in that order), or ``wait`` (loading already, or no room until a row using one ends)."""

    ready: bool = False
    load: bool = False
    evict: tuple[str, ...] = ()
    wait: bool = False


READY = Plan(ready=True)
WAIT = Plan(wait=True)


@dataclass
class AdapterResidency:
    """The adapters of one worker: resident (least recently used first), loading, pinned and in use by rows."""

    capacity: int
    clock: Callable[[], float]
    resident: OrderedDict[str, float] = field(default_factory=OrderedDict)  # name -> last use, LRU first
    loading: set[str] = field(default_factory=set)
    pinned: set[str] = field(default_factory=set)
    in_use: dict[str, int] = field(default_factory=dict)  # rows running with it now
    loads: int = 0  # since the worker started, for its heartbeat and /metrics
    evictions: int = 0

    def plan(self, name: str) -> Plan:
        """What serving a row of ``name`` takes now (nothing changes until :meth:`start_load` / :meth:`acquire`)."""
        if name in self.resident:
            return READY
        if name in self.loading:
            return WAIT
        room = self.capacity - len(self.resident) - len(self.loading)
        if room > 0:
            return Plan(load=True)
        if self.capacity <= 0:
            return WAIT
        evictable = [n for n in self.resident if n not in self.pinned and not self.in_use.get(n)]
        if len(evictable) < 1 - room:
            return WAIT
        return Plan(load=True, evict=tuple(evictable[:1 - room]))

    def start_load(self, name: str, evict: tuple[str, ...] = ()) -> None:
        """``name`` starts loading, once ``evict`` (from its :class:`Plan`) are dropped."""
        for gone in evict:
            if self.resident.pop(gone, None) is not None:
                self.evictions += 1
        self.loading.add(name)

    def loaded(self, name: str) -> None:
        self.loading.discard(name)
        self.resident[name] = self.clock()
        self.loads += 1

    def failed(self, name: str) -> None:
        """Its load failed (a missing or malformed directory): nothing is resident for it."""
        self.loading.discard(name)

    def acquire(self, name: str) -> None:
        """A row starts running with ``name`` (resident): it is used now and cannot be evicted until released."""
        self.in_use[name] = self.in_use.get(name, 0) + 1
        self.resident[name] = self.clock()
        self.resident.move_to_end(name)

    def release(self, name: str) -> None:
        n = self.in_use.get(name, 0) - 1
        if n > 0:
            self.in_use[name] = n
        else:
            self.in_use.pop(name, None)

    def pin(self, name: str, pinned: bool = True) -> None:
        if pinned:
            self.pinned.add(name)
        else:
            self.pinned.discard(name)

    def drop(self, name: str) -> bool:
        """Unload ``name`` now (its registration was removed); False while rows still use it."""
        if self.in_use.get(name):
            return False
        self.pinned.discard(name)
        return self.resident.pop(name, None) is not None

    def names(self) -> tuple[str, ...]:
        """The resident adapters, most recently used first (what the heartbeat reports)."""
        return tuple(reversed(self.resident))
