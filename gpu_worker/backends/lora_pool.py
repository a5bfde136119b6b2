"""Which adapters a worker holds, loads and lets into a decoding step.

:class:`AdapterPool` keeps the resident adapters (:class:`~tasks.policy.adapter_residency.AdapterResidency`: at most
``LLMB_MAX_ADAPTERS``, least recently used evicted first, pinned ones never, none under a running row) and loads
them on its own thread, so the decoding loop keeps running other rows meanwhile. A row asks for its adapter with
:meth:`AdapterPool.request` and gets a future: it resolves to a :class:`Lease` once the adapter is resident (the row
then joins the engine), or to an :class:`ItemError` when the adapter cannot be served (a missing or malformed
directory, a LoRA feature not implemented): that row alone is answered with it. A lease holds the adapter in use
until released (when its row ends); it keeps its weights even if the adapter is evicted afterwards. A name asked
for with another directory than the one resident is loaded again from it once no row uses the old one.

:class:`StepGate` (pure) caps the distinct adapters among the rows in the continuous engine at
``LLMB_MAX_ADAPTERS_PER_BATCH``: rows of a further adapter wait, first come first served, until the rows of one
adapter have all ended. Every decoding step takes its rows from those in the engine, so no step has more.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from gpu_worker.backends.interface import AdapterState, ItemError
from gpu_worker.backends.lora import Adapter, AdapterError
from tasks.policy.adapter_residency import AdapterResidency


@dataclass(eq=False)
class Lease:
    """A row's hold on a resident adapter; :meth:`release` (idempotent) lets it be evicted again."""

    adapter: Adapter
    _release: Callable[[str], None]
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self.adapter.name)


@dataclass
class _Waiting:
    path: str
    futures: list[Future[Lease | ItemError]] = field(default_factory=list)


class AdapterPool:
    def __init__(self, capacity: int, load: Callable[[str, str], Adapter],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.residency = AdapterResidency(capacity, clock)
        self.load = load  # (name, path) -> Adapter, or AdapterError
        self.weights: dict[str, Adapter] = {}
        self._waiting: dict[str, _Waiting] = {}  # rows waiting for each adapter, in arrival order of names
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-loader")

    @property
    def capacity(self) -> int:
        return self.residency.capacity

    def request(self, name: str, path: str | None, pinned: bool = False) -> Future[Lease | ItemError]:
        """A future lease on ``name`` (its PEFT directory ``path``), resolved as soon as the adapter is resident."""
        future: Future[Lease | ItemError] = Future()
        if self.capacity <= 0:
            future.set_result(ItemError("invalid_request", f"this worker serves no LoRA adapters "
                                        f"(LLMB_MAX_ADAPTERS=0), so not {name!r}"))
            return future
        if not path:
            future.set_result(ItemError("invalid_request", f"adapter {name!r} has no directory (adapter_path)"))
            return future
        with self._lock:
            held = self.weights.get(name)
            if held is not None and held.path != path and not self.residency.in_use.get(name):
                self.residency.drop(name)  # re-registered with another directory: load that one instead
                del self.weights[name]
            self.residency.pin(name, pinned)
            self._waiting.setdefault(name, _Waiting(path)).futures.append(future)
        self._advance()
        return future

    def state(self) -> AdapterState:
        with self._lock:
            r = self.residency
            return AdapterState(max(0, r.capacity), r.names(), tuple(sorted(r.loading)), r.loads, r.evictions)

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    # -- inside ----------------------------------------------------------------------------------------------
    def _advance(self) -> None:
        """Serve the waiting rows whose adapter is resident, start the loads there is room for, fail the hopeless."""
        settled: list[tuple[Future[Lease | ItemError], Lease | ItemError]] = []
        with self._lock:
            r = self.residency
            for name in list(self._waiting):
                plan = r.plan(name)
                if plan.ready:
                    for future in self._waiting.pop(name).futures:
                        if future.set_running_or_notify_cancel():  # its batch may have given up on it
                            r.acquire(name)
                            settled.append((future, Lease(self.weights[name], self._released)))
                elif plan.load:
                    r.start_load(name, plan.evict)
                    for gone in plan.evict:
                        self.weights.pop(gone, None)
                    self._loader.submit(self._load, name, self._waiting[name].path)
                elif name not in r.loading and not r.loading and not r.in_use:
                    # no room, and none will come: every resident adapter is pinned
                    error = ItemError("invalid_request", f"adapter {name!r} cannot be loaded: this worker's "
                                      f"{r.capacity} adapter slots all hold pinned adapters")
                    for future in self._waiting.pop(name).futures:
                        if future.set_running_or_notify_cancel():
                            settled.append((future, error))
        for future, outcome in settled:
            future.set_result(outcome)

    def _load(self, name: str, path: str) -> None:
        try:
            adapter: Adapter | ItemError = self.load(name, path)
        except AdapterError as exc:
            adapter = ItemError("invalid_request", str(exc))
        except Exception as exc:  # out of memory, an unexpected file: this adapter's rows alone
            adapter = ItemError("invalid_request", f"adapter {name!r} could not be loaded: {type(exc).__name__}: {exc}")
        failed: list[Future[Lease | ItemError]] = []
        with self._lock:
            if isinstance(adapter, ItemError):
                self.residency.failed(name)
                self.residency.pin(name, False)
                failed = self._waiting.pop(name, _Waiting(path)).futures
            else:
                self.residency.loaded(name)
                self.weights[name] = adapter
        for future in failed:
            if future.set_running_or_notify_cancel():
                future.set_result(adapter)  # type: ignore[arg-type]
        self._advance()

    def _released(self, name: str) -> None:
        with self._lock:
            self.residency.release(name)
        self._advance()


def give_up(futures: list[Future[Lease | ItemError]]) -> None:
    """A batch is done with these: cancel the leases still waiting, release the granted ones (idempotent)."""
    for future in futures:
        if future.cancel():
            continue
        outcome = future.result()
        if isinstance(outcome, Lease):
            outcome.release()


class StepGate:
    """At most ``cap`` distinct adapters among the rows admitted to the engine (pure; the engine locks around it).

    A free slot goes to the adapter of the oldest row waiting for one. Rows of adapters already admitted join at
    once, even past rows waiting for a slot (as vLLM's scheduler skips a request whose adapter cannot be added) so
    that the running adapters' rows fill the steps; but only ``bypass`` of them past the same waiting row: then
    they wait too, the running adapters drain, and the waiting row's adapter gets the next slot (no starvation)."""

    def __init__(self, cap: int, bypass: int = 64) -> None:
        self.cap = max(1, cap)
        self.bypass = bypass
        self.active: dict[str, int] = {}  # adapter -> rows admitted and not ended
        self.admitted: dict[str, str] = {}  # row id -> its adapter
        self.waiting: deque[tuple[str, str]] = deque()  # (row id, adapter), oldest first
        self.head: str | None = None  # the oldest row waiting for a slot
        self.bypassed = 0  # rows admitted past it

    def offer(self, rid: str, adapter: str) -> list[str]:
        """A row ready to run; the rows admitted now (this one among them, or none if it must wait)."""
        self.waiting.append((rid, adapter))
        return self._admit()

    def ended(self, rid: str) -> list[str]:
        """A row finished, was cancelled, or failed before admission; the rows admitted now in its place."""
        adapter = self.admitted.pop(rid, None)
        if adapter is None:
            self.waiting = deque(w for w in self.waiting if w[0] != rid)
        else:
            self.active[adapter] -= 1
            if not self.active[adapter]:
                del self.active[adapter]
        return self._admit()

    def _admit(self) -> list[str]:
        admitted, kept = [], deque[tuple[str, str]]()
        head = None
        for rid, adapter in self.waiting:
            if adapter not in self.active and len(self.active) < self.cap and head is None:
                self.active[adapter] = 0  # the oldest row waiting for a slot takes the free one
            if adapter in self.active and (head is None or self.bypassed < self.bypass):
                if head is not None:
                    self.bypassed += 1
                self.active[adapter] += 1
                self.admitted[rid] = adapter
                admitted.append(rid)
                continue
            if head is None:
                head = rid
                if head != self.head:
                    self.head, self.bypassed = head, 0
            kept.append((rid, adapter))
        self.waiting = kept
        if head is None:
            self.head, self.bypassed = None, 0
        return admitted
