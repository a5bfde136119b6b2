"""A call's ``model`` naming a LoRA adapter (issue 44), made a call of the adapter's base model: the one place every
route (native, OpenAI, Responses, Batch API lines) turns an adapter's name into what the gateway and the workers
run, before any check of the models served.

The call keeps the name it was made with in ``params.adapter`` (its answer's ``model`` echoes it, as vLLM's does:
:func:`shown_model`), and carries the adapter's directory and pin to the worker in each item's params. A name the
caller's tenant may not use (another tenant's private adapter) is left as it came, so it is refused exactly as a
model nobody serves.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace

from tasks.errors import Unavailable
from tasks.gateway.calls import Call
from tasks.store.adapters import AdapterCatalog
from webapp.services import services


def resolve(call: Call, catalog: AdapterCatalog, served: Callable[[], Collection[str]]) -> Call:
    """``call`` as it runs: on the adapter's base model with the adapter in its params when its ``model`` is an
    adapter its tenant may use (``call.tenant`` is bound already), else unchanged. ``served``: the models the fleet
    serves now, asked only when the registry has never been readable (then a name the fleet does not serve may be
    an adapter: 503, not 404)."""
    adapter = catalog.find(call.model, call.tenant)
    if adapter is None:
        if catalog.unreadable and call.model not in served():
            raise Unavailable(f"cannot tell whether {call.model!r} is a LoRA adapter: the database is unreachable")
        return call
    params = replace(call.params, adapter=adapter.name, adapter_path=adapter.path, adapter_pinned=adapter.pinned)
    return replace(call, model=adapter.base_model, params=params)


def shown_model(call: Call) -> str:
    """The model a call's answer names: the adapter the caller named, or its model."""
    return call.params.adapter or call.model


def resolved(call: Call) -> Call:
    """:func:`resolve` with this API process's catalog and fleet (a route's call, its tenant bound)."""
    s = services()
    return resolve(call, s.adapters, s.served_models)
