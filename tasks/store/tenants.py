"""Tenants and their API keys: who is calling, and what share of the system they get.

A tenant carries a weight (its share of batch slots when tenants compete), an in-flight cap and a priority class;
a tenant with no settings of its own, or a setting left empty, gets the defaults (``LLMB_TENANT_*``). API keys are
issued and revoked with ``llmb-admin keys``; the database keeps only their SHA-256, so a leaked table leaks no key.

:class:`KeyStore` is the database side (the CLI uses it directly). :class:`TenantDirectory` is what every API
request goes through: a small TTL cache in front of the store, so the hot path costs one dict lookup, a revoked key
stops working within the TTL, and a database outage keeps known keys working on their last answer. Bad keys cost
no query each: the directory holds the ids and hashes of every active key (one query per TTL), refuses any other
key from memory, and remembers refusals apart from answers, so no flood of them evicts a valid key.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Generic, NoReturn, TypeVar

from sqlalchemy import select, union, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from tasks.config import Settings
from tasks.errors import InvalidInput, Unauthorized, Unavailable
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
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


class KeyStore:
    """Tenants and API keys in the database (the ledger's, migrated by ``llmb-admin db upgrade``)."""

    def __init__(self, engine: Engine, *, weight: float = 1.0, max_in_flight: int = 5000,
                 priority: str | Priority = Priority.INTERACTIVE) -> None:
        self.engine = engine
        self.defaults = TenantPolicy("", weight, max_in_flight, check_priority(priority)).checked()

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None) -> KeyStore:
        return cls(engine or make_engine(settings.database_url), weight=settings.tenant_weight,
                   max_in_flight=settings.tenant_max_in_flight, priority=settings.tenant_priority)


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
                                             label=label, created_at=datetime.now(timezone.utc)))
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
                                   .values(revoked_at=datetime.now(timezone.utc)))
            return bool(done.rowcount == 1)  # type: ignore[attr-defined]

    def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        query = select(ApiKeyRecord).order_by(ApiKeyRecord.tenant, ApiKeyRecord.created_at, ApiKeyRecord.id)
        if tenant is not None:
            query = query.where(ApiKeyRecord.tenant == tenant)
        with Session(self.engine) as session:
            return [KeyInfo(r.id, r.tenant, r.admin, r.label, _utc(r.created_at),
                            _utc(r.revoked_at) if r.revoked_at else None) for r in session.scalars(query)]

    def active_keys(self) -> dict[str, str]:
        """Every key not revoked, id -> hash, in one query: what :class:`TenantDirectory` refuses unknown keys by."""
        query = select(ApiKeyRecord.id, ApiKeyRecord.key_hash).where(ApiKeyRecord.revoked_at.is_(None))
        with Session(self.engine) as session:
            return {key_id: key_hash for key_id, key_hash in session.execute(query)}

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
        now = datetime.now(timezone.utc)
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
        raise InvalidInput(f"weight must be a number more than 0 and at most {MAX_WEIGHT:g}, not {_shown(value)}")
    return weight


def _as_cap(value: int) -> int:
    """An in-flight cap, checked before it reaches the 32-bit column (or a message 400 digits long)."""
    cap = int(value)
    if not 1 <= cap <= MAX_IN_FLIGHT:
        raise InvalidInput(f"max_in_flight must be from 1 to {MAX_IN_FLIGHT}, not {_shown(value)}")
    return cap


def _shown(value: float) -> str:
    """A number as an error message quotes it: a huge one by its size, not its hundreds of digits."""
    if isinstance(value, int) and value.bit_length() > 64:
        try:
            return f"a {len(str(abs(value)))}-digit integer"
        except ValueError:  # past Python's limit on converting integers to text
            return f"an integer of {value.bit_length()} bits"
    return repr(value)


# -- the hot path -------------------------------------------------------------------------------------------
T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    value: T
    loaded_at: float
    expires_at: float


class _Cache(Generic[T]):
    """TTL cache in front of one kind of database lookup, bounded, serving stale answers while the database is down.

    One caller refreshes an expired entry while the others keep its old value for ``grace_s``: a hot key costs
    one query per TTL however many requests carry it. A lookup that finds nothing (None) is not remembered, and
    drops what was remembered: only answers are kept, so nothing but answers can evict answers.
    """

    def __init__(self, what: str, ttl_s: float, clock: Callable[[], float], max_entries: int) -> None:
        self.what = what
        self.ttl_s = ttl_s
        self.grace_s = min(ttl_s, 1.0)
        self.clock = clock
        self.max_entries = max_entries
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, slot: str) -> bool:
        return slot in self._entries

    def fresh(self, slot: str) -> T | None:
        """The remembered value while it is within its TTL (or another caller's refresh grace), else None."""
        entry = self._entries.get(slot)
        return entry.value if entry is not None and self.clock() < entry.expires_at else None

    def get(self, slot: str, load: Callable[[], T | None]) -> T | None:
        now = self.clock()
        with self._lock:
            entry = self._entries.get(slot)
            if entry is not None:
                if now < entry.expires_at:
                    return entry.value
                entry.expires_at = now + self.grace_s
        try:
            value = load()
        except SQLAlchemyError as exc:
            if entry is None:
                raise Unavailable(f"cannot look up the {self.what}: the database is unreachable "
                                  f"({type(exc).__name__})") from exc
            log.warning("database unreachable (%s): using the %s looked up %.1f s ago", type(exc).__name__,
                        self.what, now - entry.loaded_at)
            return entry.value
        if value is None:
            with self._lock:
                self._entries.pop(slot, None)
        else:
            self.remember(slot, value, now)
        return value

    def remember(self, slot: str, value: T, now: float) -> None:
        with self._lock:
            self._entries[slot] = _Entry(value, now, now + self.ttl_s)
            self._entries.move_to_end(slot)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


class _Misses:
    """Hashes of keys refused lately, bounded apart from the answers, so a flood of bad keys evicts only misses."""

    def __init__(self, ttl_s: float, clock: Callable[[], float], max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_entries = max_entries
        self._expiry: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, slot: str) -> bool:
        """Refused before, however long ago (the last answer, while the database cannot give a new one)."""
        return slot in self._expiry

    def fresh(self, slot: str) -> bool:
        expiry = self._expiry.get(slot)
        return expiry is not None and self.clock() < expiry

    def add(self, slot: str) -> None:
        with self._lock:
            self._expiry[slot] = self.clock() + self.ttl_s
            self._expiry.move_to_end(slot)
            while len(self._expiry) > self.max_entries:
                self._expiry.popitem(last=False)


class _KeyIndex:
    """Every active key's id and hash, loaded whole in one query, so a key the index does not hold is refused
    without a query of its own: a flood of random keys (or of guesses at a public key id) costs the database at
    most one query per ``retry_s``, however many keys it carries.

    The index is reloaded once per ``ttl_s`` (by one caller; the others use it meanwhile). A key whose id it does
    not hold may be new: its caller waits for the next reload, at most ``retry_s`` after the last, which every
    such caller shares, so a key issued a moment ago works at once, at the price of up to ``retry_s`` of wait.
    """

    def __init__(self, load: Callable[[], dict[str, str]], ttl_s: float, clock: Callable[[], float],
                 sleep: Callable[[float], None], retry_s: float = 1.0) -> None:
        self.load = load
        self.ttl_s = ttl_s
        self.clock = clock
        self.sleep = sleep
        self.retry_s = retry_s
        self.loads = 0
        self.failed = False
        self._hashes: dict[str, str] | None = None
        self._loaded_from = -math.inf  # when the last good load began: it holds every key issued before that
        self._tried_at = -math.inf  # when the last load (good or failed) began
        self._lock = threading.Lock()

    def check(self, key_id: str, key_hash: str) -> bool | None:
        """True: an active key; False: not one (refuse); None: cannot tell (the index cannot be loaded)."""
        arrived = self.clock()
        if arrived - self._loaded_from >= self.ttl_s and arrived - self._tried_at >= self.retry_s:
            self._reload(blocking=False)
        answer = self._answer(key_id, key_hash)
        if answer is not False or key_id in (self._hashes or {}) or self._loaded_from >= arrived:
            return answer  # a known id with another hash is a forgery, never a key issued since the load
        wait = self._tried_at + self.retry_s - self.clock()
        if wait > 0:
            self.sleep(wait)
        self._reload(blocking=True, unless_tried_since=arrived)
        return self._answer(key_id, key_hash)

    def _answer(self, key_id: str, key_hash: str) -> bool | None:
        if self._hashes is None:
            return None
        known = self._hashes.get(key_id)
        if known is not None:
            return hmac.compare_digest(known, key_hash)
        return None if self.failed else False

    def _reload(self, *, blocking: bool, unless_tried_since: float | None = None) -> None:
        if not self._lock.acquire(blocking=blocking):
            return  # another caller is loading it: use the index as it is
        try:
            if unless_tried_since is not None and self._tried_at >= unless_tried_since:
                return  # loaded (or tried) since this caller arrived: that answer is the one to give
            started = self._tried_at = self.clock()
            self.loads += 1
            try:
                hashes = self.load()
            except SQLAlchemyError as exc:
                if not self.failed:
                    log.warning("database unreachable (%s): API keys checked against the list of keys read "
                                "%.1f s ago", type(exc).__name__, started - self._loaded_from)
                self.failed = True
                return
            self._hashes, self._loaded_from, self.failed = hashes, started, False
        finally:
            self._lock.release()


class TenantDirectory:
    """Who is calling, for every API request: :class:`KeyStore` answers, cached for ``ttl_s``.

    Valid keys are cached by their hash (never the key) for ``ttl_s``: the hot path is one dict lookup, and a
    revoked key (or a changed tenant setting) takes effect within ``ttl_s``. Refusals are remembered apart
    (bounded on their own), so no flood of bad keys can evict a valid one, and a key whose id and hash are not
    in the per-process :class:`_KeyIndex` is refused without a query of its own. When the database fails, a key
    seen before keeps its last answer; a key never seen gets 503, not 401.
    """

    def __init__(self, store: KeyStore, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 10_000, max_misses: int = 10_000,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store = store
        self._principals: _Cache[Principal] = _Cache("API key", ttl_s, clock, max_entries)
        self._misses = _Misses(ttl_s, clock, max_misses)
        self._index = _KeyIndex(lambda: self.store.active_keys(), ttl_s, clock, sleep)
        self._policies: _Cache[TenantPolicy] = _Cache("tenant's settings", ttl_s, clock, max_entries)

    def principal(self, key: str | None) -> Principal:
        """The caller behind ``key`` (the bearer token); Unauthorized when missing, unknown or revoked."""
        if not key:
            raise Unauthorized(f"this call needs an API key: {HOW_TO_AUTH}")
        key_id = key_id_of(key)
        if key_id is None:
            raise self._refused()
        slot = hash_key(key)
        found = self._principals.fresh(slot)
        if found is not None:
            return found
        if self._misses.fresh(slot):
            raise self._refused()
        active = self._index.check(key_id, slot)
        if active is False or (active is None and slot in self._misses and slot not in self._principals):
            return self._refuse(slot)
        found = self._principals.get(slot, lambda: self.store.authenticate(key))
        if found is None:  # revoked since the index was read
            return self._refuse(slot)
        return found

    def _refuse(self, slot: str) -> NoReturn:
        self._misses.add(slot)
        raise self._refused()

    @staticmethod
    def _refused() -> Unauthorized:
        return Unauthorized(f"unknown or revoked API key: {HOW_TO_AUTH}")

    def cached_priority(self, key: str | None, tenant: str) -> Priority | None:
        """The priority class of a caller as far as the caches know it now, without a query (None: not known):
        that of the tenant of API key ``key`` when one is given (only a key looked up and valid is known), else
        that of ``tenant`` by name."""
        if key is not None:
            found = self._principals.fresh(hash_key(key))
            return None if found is None else found.tenant.priority
        policy = self._policies.fresh(tenant)
        return None if policy is None else policy.priority

    def policy(self, tenant: str) -> TenantPolicy:
        """A tenant's policy by name (when authentication is off and the caller names its tenant)."""
        check_tenant_name(tenant)
        try:
            found = self._policies.get(tenant, lambda: self.store.policy(tenant))
            assert found is not None  # a tenant without settings has the defaults
            return found
        except Unavailable:
            # Without keys nothing needs the database to be safe: serve with the defaults (for one TTL, so
            # an outage costs one failed query per tenant per TTL) rather than refuse every request.
            log.warning("database unreachable: tenant %r gets the default weight, cap and priority", tenant)
            fallback = replace(self.store.defaults, name=tenant)
            self._policies.remember(tenant, fallback, self._policies.clock())
            return fallback
