"""The admission scripts' KEYS and ARGV by name: the one place Python meets their positional interface.

Each script is a file in :mod:`tasks.state.lua` whose header lists its KEYS and ARGV index by index; here each
list is a frozen dataclass whose fields, in order, are those indexes (a field holding a tuple or a list spreads
into as many entries, a nested dataclass into its own fields). :func:`tasks.state.lua.positional` turns one into
the list the script reads, so a field is written by name at every call and its index is kept in one place.
Change a script and its dataclass together.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.state.lua import positional, source

SEP = "\t"  # between tenant, model and class in an owner hash's values (none of them can hold a tab)

ADMIT = source("admission_admit", "now", "admission_purge")
COLLECT = source("admission_collect", "admission_forget")
RELEASE = source("admission_release", "admission_forget")
RENEW = source("admission_renew", "now", "admission_forget")
OLDEST = source("admission_oldest", "now", "admission_purge")


@dataclass(frozen=True)
class AdmitKeys:
    """One call's KEYS of ``admission_admit.lua`` (12, in this order)."""

    inflight: str  # every admitted item, by deadline
    arrivals: str  # every admitted item, by arrival
    quarantine: str  # quarantined input hashes
    tenant: str  # the tenant's items, by deadline
    model: str  # the model's interactive items, by deadline
    model_arrivals: str  # the model's interactive items, by arrival
    model_rate: str  # the model's arrival counter for this second
    model_offline: str  # the model's offline items, by deadline
    offline: str  # every offline item, by deadline
    owner: str  # this API process's owner hash
    leases: str  # the API processes' leases
    record: str  # the call's record ('' for none)


@dataclass(frozen=True)
class AdmitArgs:
    """One call's ARGV of ``admission_admit.lua``; ``n`` (ARGV 5) is the number of ``item_ids``."""

    interactive_cap: int  # items
    model_cap: int  # items
    tenant_cap: int  # items
    timeout_s: float  # each item's deadline: Redis's now + this
    n: int = field(init=False)
    priority: str  # interactive | offline
    offline_cap: int  # items
    owner_entry: str  # tenant, model, class joined by SEP
    instance: str  # this API process
    lease_s: float
    valid_until: float  # Redis time: later, the call is LATE
    token_cap: int  # the model's token budget (0: none)
    record_value: str  # the record's JSON ('' for none)
    record_ttl_s: int
    item_ids: tuple[str, ...]
    hashes: tuple[str, ...]  # the items' input hashes
    tokens: tuple[int, ...]  # the items' estimated tokens (0: not generation)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", len(self.item_ids))


def admit_round(calls: Sequence[tuple[AdmitKeys, AdmitArgs]]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one ``admission_admit.lua`` call for several calls: every call's 12 keys; the number of
    calls, then per call the count of its arguments and its arguments."""
    keys: list[str] = []
    args: list[Any] = [len(calls)]
    for call_keys, call_args in calls:
        keys += positional(call_keys)
        argv = positional(call_args)
        args += [len(argv), *argv]
    return keys, args


@dataclass(frozen=True)
class ItemSets:
    """The six sets an admitted item may be in, in the order the collect and release scripts read them (removing
    it from one it is not in is a no-op that keeps the scripts' key count fixed)."""

    inflight: str
    arrivals: str
    offline: str
    tenant: str
    deadline: str  # the model's deadline set of the item's class (interactive, or :offline)
    model_arrivals: str


@dataclass(frozen=True)
class CollectKeys:
    """One call's KEYS of ``admission_collect.lua``."""

    sets: ItemSets  # 1-6
    owner: str  # 7: the API process's owner hash
    record: str  # 8: the call's record ('' for none)
    results: tuple[str, ...]  # 9..: the items' result keys


@dataclass(frozen=True)
class CollectArgs:
    """One call's ARGV of ``admission_collect.lua``."""

    finished: str  # the record as finished with 200 ('' for none)
    item_ids: tuple[str, ...]  # those of ``CollectKeys.results``, in order


def collect_round(calls: Sequence[tuple[CollectKeys, CollectArgs]]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one ``admission_collect.lua`` call for several calls: every call's keys; the number of
    calls, then per call the count of its keys, the count of its arguments, and its arguments."""
    keys: list[str] = []
    args: list[Any] = [len(calls)]
    for call_keys, call_args in calls:
        kv, argv = positional(call_keys), positional(call_args)
        keys += kv
        args += [len(kv), len(argv), *argv]
    return keys, args


@dataclass(frozen=True)
class ReleaseKeys:
    """KEYS of ``admission_release.lua`` (its ARGV: the item ids)."""

    sets: ItemSets
    owner: str


@dataclass(frozen=True)
class RenewArgs:
    """ARGV of ``admission_renew.lua`` (its one key: the leases)."""

    instance: str  # '' for a reaper holding no lease
    lease_s: float
    prefix: str  # the key prefix of the admission sets


@dataclass(frozen=True)
class OldestKeys:
    """KEYS of ``admission_oldest.lua`` (no ARGV)."""

    model: str  # the model's interactive items, by deadline
    model_arrivals: str
