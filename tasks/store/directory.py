"""Who is calling, for every API request: :class:`TenantDirectory`, the hot path in front of
:class:`tasks.store.tenants.KeyStore`, and the per-process :class:`KeyIndex` of every active key.

The hot path costs one dict lookup (:mod:`tasks.store.ttl_cache`), a revoked key stops working within the TTL, and
a database outage keeps known keys working on their last answer. Bad keys cost no query each: the index holds the
ids and hashes of every active key (one query per TTL) and refuses any other key from memory, and refusals are
remembered apart from answers, so no flood of them evicts a valid key.
"""
from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

from sqlalchemy.exc import SQLAlchemyError

from tasks.errors import Unauthorized, Unavailable
from tasks.policy.tenancy import Principal, TenantPolicy, check_tenant_name
from tasks.schema import Priority
from tasks.store.tenants import HOW_TO_AUTH, ActiveKey, KeyStore, hash_key, key_id_of
from tasks.store.ttl_cache import LookupCache, RecentMisses

log = logging.getLogger("llmb.tenants")


class KeyIndex:
    """Every active key's id, hash and tenant's priority class, loaded whole in one query, so a key the index does
    not hold is refused without a query of its own: a flood of random keys (or of guesses at a public key id) costs
    the database at most one query per ``retry_s``, however many keys it carries; and the door can place a known
    tenant's call on arrival without its key looked up (:meth:`TenantDirectory.cached_priority`).

    The index is reloaded once per ``ttl_s`` (by one caller; the others use it meanwhile). A key whose id it does
    not hold may be new: its caller waits for the next reload, at most ``retry_s`` after the last, which every
    such caller shares, so a key issued a moment ago works at once, at the price of up to ``retry_s`` of wait.
    """

    def __init__(self, load: Callable[[], dict[str, ActiveKey]], ttl_s: float, clock: Callable[[], float],
                 sleep: Callable[[float], None], retry_s: float = 1.0) -> None:
        self.load = load
        self.ttl_s = ttl_s
        self.clock = clock
        self.sleep = sleep
        self.retry_s = retry_s
        self.loads = 0
        self.failed = False
        self._keys: dict[str, ActiveKey] | None = None
        self._loaded_from = -math.inf  # when the last good load began: it holds every key issued before that
        self._tried_at = -math.inf  # when the last load (good or failed) began
        self._lock = threading.Lock()

    def check(self, key_id: str, key_hash: str) -> bool | None:
        """True: an active key; False: not one (refuse); None: cannot tell (the index cannot be loaded)."""
        arrived = self.clock()
        self.refresh()
        answer = self._answer(key_id, key_hash)
        if answer is not False or key_id in (self._keys or {}) or self._loaded_from >= arrived:
            return answer  # a known id with another hash is a forgery, never a key issued since the load
        wait = self._tried_at + self.retry_s - self.clock()
        if wait > 0:
            self.sleep(wait)
        self._reload(blocking=True, unless_tried_since=arrived)
        return self._answer(key_id, key_hash)

    def holds(self, key_id: str, key_hash: str) -> bool:
        """Whether the index as loaded holds this active key: from memory only (no load, no wait)."""
        return self.priority(key_id, key_hash) is not None

    def priority(self, key_id: str, key_hash: str) -> Priority | None:
        """The priority class of this active key's tenant as the index was loaded (None: it holds no such key):
        from memory only."""
        known = (self._keys or {}).get(key_id)
        return known.priority if known is not None and hmac.compare_digest(known.key_hash, key_hash) else None

    def refresh(self) -> None:
        """Load the index again if it is older than its TTL (another caller loading it: nothing): at each check,
        and between calls, so that the door knows a key issued while no call came
        (:meth:`TenantDirectory.cached_priority`)."""
        now = self.clock()
        if now - self._loaded_from >= self.ttl_s and now - self._tried_at >= self.retry_s:
            self._reload(blocking=False)

    def _answer(self, key_id: str, key_hash: str) -> bool | None:
        if self._keys is None:
            return None
        known = self._keys.get(key_id)
        if known is not None:
            return hmac.compare_digest(known.key_hash, key_hash)
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
                keys = self.load()
            except SQLAlchemyError as exc:
                if not self.failed:
                    log.warning("database unreachable (%s): API keys checked against the list of keys read "
                                "%.1f s ago", type(exc).__name__, started - self._loaded_from)
                self.failed = True
                return
            self._keys, self._loaded_from, self.failed = keys, started, False
        finally:
            self._lock.release()


class TenantDirectory:
    """Who is calling, for every API request: :class:`KeyStore` answers, cached for ``ttl_s``.

    Valid keys are cached by their hash (never the key) for ``ttl_s``: the hot path is one dict lookup, and a
    revoked key (or a changed tenant setting) takes effect within ``ttl_s``. Refusals are remembered apart
    (bounded on their own), so no flood of bad keys can evict a valid one, and a key whose id and hash are not
    in the per-process :class:`KeyIndex` is refused without a query of its own. When the database fails, a key
    seen before keeps its last answer; a key never seen gets 503, not 401.
    """

    def __init__(self, store: KeyStore, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 10_000, max_misses: int = 10_000,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.store = store
        self._principals: LookupCache[Principal] = LookupCache("API key", ttl_s, clock, max_entries)
        self._misses = RecentMisses(ttl_s, clock, max_misses)
        # time.sleep looked up when called: this module is imported before gevent patches it in a gunicorn worker,
        # and the unpatched one would stop the whole process for every caller waiting for the index
        self._index = KeyIndex(lambda: self.store.active_keys(), ttl_s, clock,
                               sleep or (lambda seconds: time.sleep(seconds)))
        self._policies: LookupCache[TenantPolicy] = LookupCache("tenant's settings", ttl_s, clock, max_entries)

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
        """The priority class of a caller as far as memory tells now, without a query (None: not known): that of
        the tenant of API key ``key`` when one is given (a key looked up lately, or one the index holds), else
        that of ``tenant`` by name. Only the fresh lookups told it once: a tenant quiet for longer than their TTL
        (LLMB_AUTH_CACHE_S, 5 s) then had every call of its next burst go the usual way, unjudged on arrival, in
        each process until its first call was through authentication."""
        if key is not None:
            slot = hash_key(key)
            found = self._principals.fresh(slot)
            if found is not None:
                return found.tenant.priority
            key_id = key_id_of(key)
            return None if key_id is None else self._index.priority(key_id, slot)
        policy = self._policies.fresh(tenant)
        return None if policy is None else policy.priority

    def refresh_index(self) -> None:
        """Load the key index again once it is older than the TTL (:meth:`KeyIndex.refresh`)."""
        self._index.refresh()

    def known_caller(self, key: str) -> str | None:
        """Who calls with ``key`` as far as memory tells, without a query or a wait (the door names callers with
        it on every arrival): its tenant once the key has been looked up, ``key <id>`` for an active key the
        index holds but no call has looked up yet (one name per real key), None for any other key."""
        key_id = key_id_of(key)
        if key_id is None:
            return None  # malformed: not even hashed
        slot = hash_key(key)
        found = self._principals.fresh(slot)
        if found is not None:
            return str(found.tenant.name)
        return f"key {key_id}" if self._index.holds(key_id, slot) else None

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
