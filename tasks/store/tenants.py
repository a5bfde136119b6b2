"""Tenants and their API keys in the database: who is calling, and what share of the system they get.

A tenant carries a weight (its share of batch slots when tenants compete), an in-flight cap and a priority class;
a tenant with no settings of its own, or a setting left empty, gets the defaults (``LLMB_TENANT_*``). API keys are
issued and revoked with ``llmb-admin keys``; the database keeps only their SHA-256, so a leaked table leaks no key.

:class:`KeyStore` is the database side (the CLI uses it directly). Every API request goes through
:class:`tasks.store.directory.TenantDirectory` instead: the store behind TTL caches (:mod:`tasks.store.ttl_cache`)
and an index of every active key, so that the hot path costs no query.
"""
from __future__ import annotations

import hashlib
import logging
import math
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, union, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tasks.config import Settings
from tasks.errors import InvalidInput
from tasks.policy.tenancy import (
    MAX_IN_FLIGHT,
    MAX_WEIGHT,
    Principal,
    TenantPolicy,
    check_priority,
    check_tenant_name,
)
from tasks.schema import Priority
from tasks.store.models import ApiKeyRecord, TenantRecord, make_engine

log = logging.getLogger("llmb.tenants")

KEY_FORMAT = re.compile(r"^llmb_([0-9a-f]{8})_[A-Za-z0-9_-]{16,128}$")
HOW_TO_AUTH = "send Authorization: Bearer <key>; keys are issued with `llmb-admin keys create <tenant>`"


@dataclass(frozen=True)
class KeyInfo:
    """What may be shown about a key: never the key, nor its hash."""

    id: str
    tenant: str
    admin: bool
    label: str | None
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class ActiveKey:
    """An active key as each API process's index holds it: its hash, and its tenant's priority class, by which the
    door places a call on arrival before any lookup of the key (:mod:`webapp.accept_door`)."""

    key_hash: str
    priority: Priority


def new_key() -> tuple[str, str]:
    """(key_id, key): the id is public (lists, logs, revocation); the key is shown once and never stored."""
    key_id = secrets.token_hex(4)
    return key_id, f"llmb_{key_id}_{secrets.token_urlsafe(32)}"


def hash_key(key: str) -> str:
    """SHA-256 of the key, hex: what the database stores and looks keys up by.

    Plain SHA-256, not bcrypt or argon2: those slow hashes protect low-entropy passwords from guessing, but a key
    holds 256 random bits, so no guessing can find one from its fast hash either. A fast, unsalted hash also keeps
    authentication one indexed lookup per request, as GitHub's and Stripe's API tokens do.
    """
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The id inside a well-formed key, or None: malformed keys are refused without asking the database."""
    match = KEY_FORMAT.match(key)
    return match.group(1) if match else None


def _utc(value: datetime) -> datetime:
    """SQLite hands timezone-aware columns back naive; they were written in UTC."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


class KeyStore:
    """Tenants and API keys in the database (the ledger's, migrated by ``llmb-admin db upgrade``)."""

    def __init__(self, engine: Engine, *, weight: float = 1.0, max_in_flight: int = 5000,
                 priority: str | Priority = Priority.INTERACTIVE) -> None:
        self.engine = engine
        self.defaults = TenantPolicy("", weight, max_in_flight, check_priority(priority)).checked()

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None) -> KeyStore:
        return cls(engine or make_engine(settings.stores.database_url), weight=settings.tenants.weight,
                   max_in_flight=settings.tenants.max_in_flight, priority=settings.tenants.priority)


    # -- keys ---------------------------------------------------------------------------------------------
    def create_key(self, tenant: str, admin: bool = False, label: str | None = None) -> tuple[str, str]:
        """Issue a key; returns (key_id, key). The key is in no table: this is the only time anyone sees it."""
        check_tenant_name(tenant)
        if label is not None and len(label) > 128:
            raise ValueError("a key's label is at most 128 characters")
        for attempt in range(3):
            key_id, key = new_key()
            try:
                with Session(self.engine) as session, session.begin():
                    session.add(ApiKeyRecord(id=key_id, tenant=tenant, key_hash=hash_key(key), admin=admin,
                                             label=label, created_at=datetime.now(UTC)))
                return key_id, key
            except IntegrityError:  # an 8-hex-digit id taken already: rare, and a new one is free
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def revoke(self, key_id: str) -> bool:
        """False when no key has this id or it was revoked already."""
        with Session(self.engine) as session, session.begin():
            done = session.execute(update(ApiKeyRecord)
                                   .where(ApiKeyRecord.id == key_id, ApiKeyRecord.revoked_at.is_(None))
                                   .values(revoked_at=datetime.now(UTC)))
            return bool(done.rowcount == 1)  # type: ignore[attr-defined]

    def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        query = select(ApiKeyRecord).order_by(ApiKeyRecord.tenant, ApiKeyRecord.created_at, ApiKeyRecord.id)
        if tenant is not None:
            query = query.where(ApiKeyRecord.tenant == tenant)
        with Session(self.engine) as session:
            return [KeyInfo(r.id, r.tenant, r.admin, r.label, _utc(r.created_at),
                            _utc(r.revoked_at) if r.revoked_at else None) for r in session.scalars(query)]

    def active_keys(self) -> dict[str, ActiveKey]:
        """Every key not revoked, by id, with its tenant's priority class, in one query: what
        :class:`tasks.store.directory.TenantDirectory` refuses unknown keys by, and places calls by on arrival."""
        query = (select(ApiKeyRecord.id, ApiKeyRecord.key_hash, ApiKeyRecord.tenant, TenantRecord)
                 .outerjoin(TenantRecord, TenantRecord.name == ApiKeyRecord.tenant)
                 .where(ApiKeyRecord.revoked_at.is_(None)))
        with Session(self.engine) as session:
            return {key_id: ActiveKey(key_hash, self._merge(tenant, record).priority)
                    for key_id, key_hash, tenant, record in session.execute(query)}

    def authenticate(self, key: str) -> Principal | None:
        """The key's principal, in one indexed query; None for a malformed, unknown or revoked key."""
        if key_id_of(key) is None:
            return None
        query = (select(ApiKeyRecord, TenantRecord)
                 .outerjoin(TenantRecord, TenantRecord.name == ApiKeyRecord.tenant)
                 .where(ApiKeyRecord.key_hash == hash_key(key)))
        with Session(self.engine) as session:
            row = session.execute(query).first()
        if row is None or row[0].revoked_at is not None:
            return None
        record, tenant = row
        return Principal(self._merge(record.tenant, tenant), record.id, record.admin)

    # -- tenants ------------------------------------------------------------------------------------------
    def set_tenant(self, name: str, *, weight: float | None = None, max_in_flight: int | None = None,
                   priority: str | Priority | None = None) -> TenantPolicy:
        """Create or change a tenant's settings; what is not given stays as it was (a new tenant: the default).

        A new tenant's weight is written as the current default: the column is never empty.
        """
        check_tenant_name(name)
        changes: dict[str, object] = {}
        if weight is not None:
            weight = changes["weight"] = _as_weight(weight)
        if max_in_flight is not None:
            max_in_flight = changes["max_in_flight"] = _as_cap(max_in_flight)
        if priority is not None:
            changes["priority"] = check_priority(priority).value
        TenantPolicy(name, weight if weight is not None else self.defaults.weight,
                     max_in_flight if max_in_flight is not None else self.defaults.max_in_flight,
                     self.defaults.priority).checked()
        now = datetime.now(UTC)
        row = {"name": name, "weight": self.defaults.weight, "max_in_flight": None, "priority": None,
               "created_at": now, "updated_at": now} | changes
        with Session(self.engine) as session, session.begin():
            insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
            stmt = insert(TenantRecord).values(row)
            session.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={**changes, "updated_at": now}))
        return self.policy(name)

    def policy(self, name: str) -> TenantPolicy:
        """The tenant's settings over the defaults; the defaults alone for a tenant with no record."""
        with Session(self.engine) as session:
            return self._merge(name, session.get(TenantRecord, name))

    def list_tenants(self) -> list[TenantPolicy]:
        """Every tenant with settings or a key, by name."""
        names = union(select(TenantRecord.name), select(ApiKeyRecord.tenant))
        with Session(self.engine) as session:
            records = {r.name: r for r in session.scalars(select(TenantRecord))}
            return [self._merge(name, records.get(name)) for name in sorted(session.scalars(names))]

    def _merge(self, name: str, record: TenantRecord | None) -> TenantPolicy:
        d = self.defaults
        if record is None:
            return TenantPolicy(name, d.weight, d.max_in_flight, d.priority)
        priority = d.priority
        if record.priority:
            try:
                priority = Priority(record.priority)
            except ValueError:  # written by hand: serve on, with the default
                log.warning("tenant %s has unknown priority %r; using %s", name, record.priority, d.priority)
        return TenantPolicy(name, record.weight if record.weight is not None else d.weight,
                            record.max_in_flight if record.max_in_flight is not None else d.max_in_flight, priority)


def _as_weight(value: float) -> float:
    """A weight as its float column holds it. JSON (and Python) integers have no size limit: one too large for a
    float is out of range like any other, an InvalidInput saying the range, never an OverflowError (a 500)."""
    try:
        weight = float(value)
    except OverflowError:
        weight = math.inf
    if not (0 < weight <= MAX_WEIGHT and math.isfinite(weight)):
        raise InvalidInput(f"'weight' must be a number more than 0 and at most {MAX_WEIGHT:g}, not {_shown(value)}")
    return weight


def _as_cap(value: int) -> int:
    """An in-flight cap, checked before it reaches the 32-bit column (or a message 400 digits long)."""
    cap = int(value)
    if not 1 <= cap <= MAX_IN_FLIGHT:
        raise InvalidInput(f"'max_in_flight' must be from 1 to {MAX_IN_FLIGHT}, not {_shown(value)}")
    return cap


def _shown(value: float) -> str:
    """A number as an error message quotes it: a huge one by its size, not its hundreds of digits."""
    if isinstance(value, int) and value.bit_length() > 64:
        try:
            return f"a {len(str(abs(value)))}-digit integer"
        except ValueError:  # past Python's limit on converting integers to text
            return f"an integer of {value.bit_length()} bits"
    return repr(value)
