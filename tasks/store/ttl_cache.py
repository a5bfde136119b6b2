"""Bounded TTL caches in front of database lookups: what keeps the API's hot path off the database.

:class:`LookupCache` remembers answers (serving the last one while the database is down); :class:`RecentMisses`
remembers refusals apart, bounded on their own, so that no flood of misses can evict an answer. Both are generic:
:class:`tasks.store.directory.TenantDirectory` keeps API keys' principals and tenants' policies in them.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from tasks.errors import Unavailable

log = logging.getLogger("llmb.tenants")  # the directory's logger: its caches' warnings are about its lookups

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    value: T
    loaded_at: float
    expires_at: float


class LookupCache(Generic[T]):
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


class RecentMisses:
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
