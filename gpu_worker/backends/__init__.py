"""Model backends: the model is a black box that maps N inputs to N outputs, in order.

Backends are looked up by name so that heavy ones (torch, transformers) are imported only by the workers
that use them.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from tasks.config import Settings


class Backend(Protocol):
    name: str  # the model name this backend serves; requests are routed by it
    max_batch: int  # most inputs one run() takes

    def run(self, inputs: Sequence[str]) -> list[Any]:
        """Outputs for ``inputs``: same length, same order. Raise on failure; never return a partial list."""
        ...


def load_backend(kind: str, settings: Settings, model: str | None = None) -> Backend:
    """Build and warm up a backend; raises ValueError with the list of kinds for an unknown one."""
    if kind == "sim":
        from gpu_worker.backends.sim import SimBackend

        return SimBackend(name=model or "sim", batch_ms=settings.sim_batch_ms, item_ms=settings.sim_item_ms,
                          max_batch=settings.sim_max_batch, raise_on=settings.sim_raise_on,
                          kill_on=settings.sim_kill_on)
    raise ValueError(f"unknown backend {kind!r}; available: sim")
