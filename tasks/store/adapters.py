"""Registered LoRA adapters (issue 44): a tenant's fine-tune of a served base model, called by its own name.

An adapter is a PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors`` or ``.bin``) registered
against a base model under a name no model and no other adapter has, owned by one tenant (only its calls may name
it) or shared (``tenant`` None: every tenant's may). A call naming it runs on its base model with its directory in
the params (:mod:`webapp.adapter_names`); the workers load it from that path, so the path is the one the workers
see (the registering host checks it too: it must exist here).

:class:`AdapterStore` is the database side (the CLI and the admin API use it); API processes read the whole table
through :class:`AdapterCatalog`, once per ``LLMB_ADAPTER_CACHE_S``, so a call never waits on the database and a
registration takes effect within that time. The table is bounded (``LLMB_MAX_REGISTERED_ADAPTERS``), so the
catalog is too.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import delete, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from tasks.config import Settings
from tasks.errors import AdapterConflict, AdapterLimit, InvalidInput, Unavailable
from tasks.policy.tenancy import check_tenant_name
from tasks.store.models import AdapterRecord, make_engine
from tasks.store.ttl_cache import LookupCache

log = logging.getLogger("llmb.adapters")

# as a call's "model" may be (webapp.validation.MODEL): an adapter is named where a model is
NAME = re.compile(r"^[A-Za-z0-9._/-]{1,128}$")
CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MAX_RANK = 4096
LOCK_KEY = 440_044  # PostgreSQL's advisory lock of registrations


@dataclass(frozen=True)
class Adapter:
    """One registered adapter, as the registry and the API show it."""

    name: str
    base_model: str
    path: str
    rank: int
    tenant: str | None  # None: shared with every tenant
    pinned: bool
    created_at: datetime

    def usable_by(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "base_model": self.base_model, "path": self.path, "rank": self.rank,
                "tenant": self.tenant, "pinned": self.pinned, "created_at": self.created_at.isoformat()}


def check_name(name: object, what: str = "an adapter's name") -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidInput(f"{what} must be 1-128 characters of letters, digits, '.', '_', '-' or '/', "
                           f"not {name!r}")
    return name


def peft_rank(path: str) -> int:
    """The rank ``r`` of the PEFT LoRA directory at ``path``, after checking it holds what a worker loads: its
    ``adapter_config.json`` (a LoRA config with a positive integer ``r``) and its weights. InvalidInput (saying
    what is missing) otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidInput(f"the adapter's path {path!r} is not a directory (give the PEFT directory, as the "
                           "workers see it)")
    config_file = folder / CONFIG
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidInput(f"{path!r} holds no {CONFIG}: not a PEFT adapter directory") from None
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{config_file} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{config_file} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidInput(f"{config_file} is a {peft_type!r} adapter; only LoRA adapters are served")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise InvalidInput(f"{config_file} must give the LoRA rank 'r' as an integer from 1 to {MAX_RANK}, "
                           f"not {rank!r}")
    if not any((folder / w).is_file() for w in WEIGHTS):
        raise InvalidInput(f"{path!r} holds no weights ({' or '.join(WEIGHTS)})")
    return rank


def _utc(value: datetime) -> datetime:
    """SQLite hands timezone-aware columns back naive; they were written in UTC."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _adapter(r: AdapterRecord) -> Adapter:
    return Adapter(r.name, r.base_model, r.path, r.rank, r.tenant, bool(r.pinned), _utc(r.created_at))


class AdapterStore:
    """The ``adapters`` table: register, list and remove, with the name, directory and bound checked here (one
    place, for the CLI and the admin API alike)."""

    def __init__(self, engine: Engine, max_adapters: int = 1000) -> None:
        self.engine = engine
        self.max_adapters = max_adapters

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None) -> AdapterStore:
        return cls(engine or make_engine(settings.stores.database_url), settings.tenants.max_registered_adapters)

    def add(self, name: str, base_model: str, path: str, *, tenant: str | None = None, pinned: bool = False,
            served: Collection[str] = ()) -> Adapter:
        """Register an adapter. ``served``: the models the fleet serves now, whose names an adapter may not take.
        InvalidInput for a bad name or directory, AdapterConflict for a name taken, AdapterLimit past the bound."""
        check_name(name)
        check_name(base_model, "the base model's name")
        if tenant is not None:
            check_tenant_name(tenant)
        if name in served:
            raise AdapterConflict(f"{name!r} is the name of a model the fleet serves; give the adapter another")
        if name == base_model:
            raise AdapterConflict(f"an adapter cannot be named as its base model {base_model!r}")
        path = os.path.abspath(os.path.expanduser(path))
        rank = peft_rank(path)
        added = Adapter(name, base_model, path, rank, tenant, pinned, datetime.now(UTC))
        try:
            with Session(self.engine) as session, session.begin():
                if session.get_bind().dialect.name == "postgresql":  # registrations one at a time: a strict bound
                    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
                if session.get(AdapterRecord, name) is not None:
                    raise AdapterConflict(f"an adapter named {name!r} is registered already (remove it first: "
                                          f"`llmb-admin adapters remove {name}`)")
                # inserted, then counted: on SQLite the insert holds the write lock, so the count is exact too
                session.add(AdapterRecord(name=name, base_model=base_model, path=path, rank=rank, tenant=tenant,
                                          pinned=pinned, created_at=added.created_at))
                session.flush()
                count = session.scalar(select(func.count()).select_from(AdapterRecord)) or 0
                if count > self.max_adapters:
                    raise AdapterLimit(f"{count - 1} adapters are registered, the most LLMB_MAX_REGISTERED_ADAPTERS "
                                       f"allows ({self.max_adapters}); remove one first")
        except IntegrityError:  # registered by another caller between the check and the insert
            raise AdapterConflict(f"an adapter named {name!r} is registered already") from None
        return added

    def remove(self, name: str) -> bool:
        """False when no adapter has this name."""
        with Session(self.engine) as session, session.begin():
            done = session.execute(delete(AdapterRecord).where(AdapterRecord.name == name))
            return bool(done.rowcount == 1)  # type: ignore[attr-defined]

    def get(self, name: str) -> Adapter | None:
        with Session(self.engine) as session:
            record = session.get(AdapterRecord, name)
            return None if record is None else _adapter(record)

    def list(self, tenant: str | None = None, limit: int | None = None) -> list[Adapter]:
        """Every adapter by name (``tenant``: those it may use, its own and the shared ones)."""
        query = select(AdapterRecord).order_by(AdapterRecord.name)
        if tenant is not None:
            query = query.where((AdapterRecord.tenant == tenant) | AdapterRecord.tenant.is_(None))
        if limit is not None:
            query = query.limit(limit)
        with Session(self.engine) as session:
            return [_adapter(r) for r in session.scalars(query)]


class AdapterCatalog:
    """Every registered adapter by name, as an API process reads it: the whole table, read by one caller once per
    ``ttl_s`` (the others use the last reading meanwhile), so the hot path is a dict lookup. While the database is
    down the last reading serves on. Before any reading has succeeded, :meth:`find` answers None (unknown) and
    :attr:`unreadable` says so, for the caller to answer 503 rather than 404 for a name it does not serve; the
    table is then tried at most once per ``retry_s``, so a flood of made-up model names costs the database nothing
    more."""

    def __init__(self, load: Callable[[], list[Adapter]], ttl_s: float,
                 clock: Callable[[], float] = time.monotonic, retry_s: float = 1.0) -> None:
        self._cache: LookupCache[dict[str, Adapter]] = LookupCache("registered adapters", ttl_s, clock, 1)
        self._load = load
        self.clock = clock
        self.retry_s = retry_s
        self.unreadable = False
        self._failed_at = -math.inf
        self._reread = False

    @classmethod
    def from_store(cls, store: AdapterStore, ttl_s: float,
                   clock: Callable[[], float] = time.monotonic) -> AdapterCatalog:
        bound = store.max_adapters

        def load() -> list[Adapter]:
            found = store.list(limit=bound + 1)
            if len(found) > bound:
                log.warning("more adapters are registered than LLMB_MAX_REGISTERED_ADAPTERS (%d): the first %d by "
                            "name are served", bound, bound)
            return found[:bound]

        return cls(load, ttl_s, clock)

    def refresh(self) -> None:
        """Read the table again at the next lookup, whatever the TTL (this process registered or removed one); the
        reading before serves on if that fails."""
        self._reread = True

    def all(self) -> dict[str, Adapter]:
        now = self.clock()
        if self.unreadable and now - self._failed_at < self.retry_s:
            return {}
        if self._reread:
            self._reread = False
            with contextlib.suppress(SQLAlchemyError):  # the last reading serves on; the TTL's read tries again
                self._cache.remember("all", self._read(), now)
        try:
            found = self._cache.get("all", self._read)
        except Unavailable:
            self.unreadable, self._failed_at = True, now
            return {}
        self.unreadable = False
        return found or {}

    def _read(self) -> dict[str, Adapter]:
        return {a.name: a for a in self._load()}

    def find(self, name: str, tenant: str) -> Adapter | None:
        """The adapter ``name`` if ``tenant`` may use it; None for any other name (another tenant's private
        adapter is no different from a name never registered)."""
        found = self.all().get(name)
        return found if found is not None and found.usable_by(tenant) else None

    def usable(self, tenant: str) -> list[Adapter]:
        return [a for a in self.all().values() if a.usable_by(tenant)]
