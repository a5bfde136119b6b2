"""Tenants and API keys: the store on real databases, the cached directory the API uses, and `llmb-admin`."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from harness.stack import BIN, ROOT
from tasks.errors import InvalidInput, Unauthorized, Unavailable
from tasks.policy.tenancy import Principal, TenantPolicy
from tasks.schema import Priority
from tasks.store.directory import TenantDirectory
from tasks.store.models import ApiKeyRecord, Base, TenantRecord, make_engine
from tasks.store.tenants import (
    KEY_FORMAT,
    ActiveKey,
    KeyStore,
    hash_key,
    key_id_of,
    new_key,
)
from tests.fakes import FakeClock

UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:1/none"


def admin(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BIN / "llmb-admin"), "--database-url", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def store_for(url: str) -> KeyStore:
    return KeyStore(make_engine(url), weight=1.0, max_in_flight=100, priority="interactive")


@pytest.fixture
def store(database_url: str) -> KeyStore:
    """A store on a database migrated as an operator would."""
    admin(database_url, "db", "upgrade")
    return store_for(database_url)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> KeyStore:
    """A store on SQLite, for what does not depend on the database kind (the directory's cache)."""
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    return store_for(url)


class Counting:
    """Counts calls through to the store's lookups: per key or tenant (``calls``), and whole key lists (``lists``)."""

    def __init__(self, store: KeyStore) -> None:
        self.calls = 0
        self.lists = 0
        self.store = store
        for name in ("authenticate", "policy"):
            setattr(store, name, self._counted(getattr(store, name)))
        listing = store.active_keys

        def active_keys() -> dict[str, ActiveKey]:
            self.lists += 1
            return listing()
        store.active_keys = active_keys  # type: ignore[method-assign]

    def _counted(self, fn: Callable[[str], object]) -> Callable[[str], object]:
        def call(arg: str) -> object:
            self.calls += 1
            return fn(arg)
        return call


# -- the store, on SQLite and PostgreSQL ------------------------------------------------------------------
def test_the_migration_matches_the_models_both_ways(database_url: str) -> None:
    admin(database_url, "db", "upgrade")
    engine = make_engine(database_url)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    assert {ix["name"] for ix in inspect(engine).get_indexes("api_keys")} >= {"ix_api_keys_tenant"}
    admin(database_url, "db", "downgrade", "0001")
    tables = set(inspect(make_engine(database_url)).get_table_names())
    assert "requests" in tables and not {"tenants", "api_keys"} & tables


def test_a_key_authenticates_as_its_tenant_until_revoked(store: KeyStore) -> None:
    store.set_tenant("team-a", weight=3, priority="offline")
    key_id, key = store.create_key("team-a", label="ci bot")
    assert store.authenticate(key) == Principal(TenantPolicy("team-a", 3.0, 100, Priority.OFFLINE), key_id, False)
    admin_id, admin_key = store.create_key("ops", admin=True)
    assert store.authenticate(admin_key) == Principal(TenantPolicy("ops", 1.0, 100, Priority.INTERACTIVE),
                                                      admin_id, True)

    assert store.revoke(key_id) is True
    assert store.authenticate(key) is None
    assert store.revoke(key_id) is False, "already revoked"
    assert store.revoke("00000000") is False, "unknown"
    assert store.authenticate(admin_key) is not None, "revoking one key leaves the others"

    listed = {k.id: k for k in store.list_keys()}
    assert set(listed) == {key_id, admin_id}
    assert listed[key_id].revoked_at is not None and listed[admin_id].revoked_at is None
    assert listed[key_id].label == "ci bot" and listed[admin_id].admin
    assert listed[key_id].created_at.tzinfo is not None
    assert [k.id for k in store.list_keys(tenant="ops")] == [admin_id]


def test_unknown_and_malformed_keys_are_refused(store: KeyStore) -> None:
    key_id, key = store.create_key("team-a")
    other = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert store.authenticate(other) is None
    assert store.authenticate(new_key()[1]) is None, "well formed, never issued"
    for malformed in ("", "nope", key[5:], f"llmb_{key_id}", f"llmb_{key_id}_short", key + " ", "x" * 10_000):
        assert store.authenticate(malformed) is None, malformed
    assert store.authenticate(key) is not None


def test_only_the_hash_of_a_key_is_stored(store: KeyStore) -> None:
    _, key = store.create_key("team-a", label="label")
    secret = key.split("_", 2)[2]
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM api_keys")).all()
    cells = [str(value) for row in rows for value in row]
    assert not [c for c in cells if key in c or secret in c]
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest() and hash_key(key) in cells


def test_tenant_settings_are_validated_and_fall_back_to_defaults(store: KeyStore) -> None:
    assert store.policy("nobody") == TenantPolicy("nobody", 1.0, 100, Priority.INTERACTIVE)
    assert store.set_tenant("team-a", weight=2.5) == TenantPolicy("team-a", 2.5, 100, Priority.INTERACTIVE)
    assert store.set_tenant("team-a", priority=Priority.OFFLINE) == TenantPolicy("team-a", 2.5, 100, Priority.OFFLINE)
    assert store.set_tenant("team-a", max_in_flight=7).max_in_flight == 7
    assert store.policy("team-a") == TenantPolicy("team-a", 2.5, 7, Priority.OFFLINE)
    assert store.set_tenant("team-b") == TenantPolicy("team-b", 1.0, 100, Priority.INTERACTIVE)

    for bad in ({"weight": 0}, {"weight": -1}, {"weight": float("nan")}, {"weight": float("inf")},
                {"max_in_flight": 0}, {"priority": "urgent"}):
        with pytest.raises(ValueError, match=r"must be|is not one of"):
            store.set_tenant("team-a", **bad)
    for name in ("", "a b", "x" * 65, "é", "a/b"):
        with pytest.raises(ValueError, match="is not 1-64 characters"):
            store.set_tenant(name)
        with pytest.raises(ValueError, match="is not 1-64 characters"):
            store.create_key(name)
    with pytest.raises(ValueError, match="'weight' must be a number"):
        KeyStore(store.engine, weight=0)
    with pytest.raises(ValueError, match="is not one of interactive, offline"):
        KeyStore(store.engine, priority="urgent")
    assert store.policy("team-a") == TenantPolicy("team-a", 2.5, 7, Priority.OFFLINE), "failed calls change nothing"

    store.create_key("with-key-only")
    assert [p.name for p in store.list_tenants()] == ["team-a", "team-b", "with-key-only"]
    assert store.list_tenants()[2] == TenantPolicy("with-key-only", 1.0, 100, Priority.INTERACTIVE)


def test_a_number_no_column_holds_is_invalid_input_with_a_short_message(sqlite_store: KeyStore) -> None:
    """JSON integers have no size limit: 400 digits used to reach float() and raise OverflowError (a 500)."""
    for bad in ({"weight": 10**400}, {"weight": -(10**400)}, {"max_in_flight": 10**400}, {"max_in_flight": 2**31},
                {"weight": 10**5000}):
        with pytest.raises(InvalidInput) as info:
            sqlite_store.set_tenant("team-a", **bad)  # type: ignore[arg-type]
        assert "must be" in info.value.message and len(info.value.message) < 120, info.value.message
    with pytest.raises(InvalidInput, match="not a 401-digit integer"):
        sqlite_store.set_tenant("team-a", weight=10**400)
    assert sqlite_store.set_tenant("team-a", weight=1000, max_in_flight=2**31 - 1).weight == 1000.0
    assert [p.name for p in sqlite_store.list_tenants()] == ["team-a"]


# -- the directory: the cache every API request goes through ----------------------------------------------
def test_a_revoked_key_works_until_the_ttl_then_never(sqlite_store: KeyStore) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=5.0, clock=clock)
    key_id, key = sqlite_store.create_key("team-a")
    assert directory.principal(key).key_id == key_id
    sqlite_store.revoke(key_id)
    clock.advance(4.9)
    assert directory.principal(key).tenant.name == "team-a", "cached for the ttl"
    clock.advance(0.1)
    with pytest.raises(Unauthorized) as refused:
        directory.principal(key)
    assert "Authorization: Bearer <key>" in refused.value.message
    assert "llmb-admin keys create <tenant>" in refused.value.message


def test_missing_and_unknown_keys_are_refused_without_a_query_each(sqlite_store: KeyStore) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=5.0, clock=clock, sleep=clock.sleep)
    counting = Counting(sqlite_store)
    for missing in (None, ""):
        with pytest.raises(Unauthorized, match="needs an API key"):
            directory.principal(missing)
    with pytest.raises(Unauthorized, match="unknown or revoked"):
        directory.principal("not-a-key")
    assert counting.calls == counting.lists == 0, "malformed keys never reach the database"

    _, unknown = new_key()
    for _ in range(3):
        with pytest.raises(Unauthorized, match="unknown or revoked"):
            directory.principal(unknown)
    assert (counting.calls, counting.lists) == (0, 1), "one list of the active keys, no lookup of this one"
    clock.advance(5)
    with pytest.raises(Unauthorized):
        directory.principal(unknown)
    assert (counting.calls, counting.lists) == (0, 2), "the list is read again once per ttl"

    clock.advance(1)
    _, key = sqlite_store.create_key("team-a")
    for _ in range(3):
        directory.principal(key)
    assert (counting.calls, counting.lists) == (1, 3), "a valid key: the list read again, one lookup, then cached"
    cached = [*directory._principals._entries, *directory._misses._expiry]
    assert hash_key(key) in cached and not [s for s in cached if key in s or unknown in s], "cached by hash only"


def test_a_key_issued_after_the_list_was_read_works_after_one_shared_wait(sqlite_store: KeyStore) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=60.0, clock=clock, sleep=clock.sleep)
    counting = Counting(sqlite_store)
    _, old = sqlite_store.create_key("team-a")
    directory.principal(old)
    assert counting.lists == 1 and clock.sleeps == []
    clock.advance(0.25)
    key_id, fresh = sqlite_store.create_key("team-b")
    assert directory.principal(fresh).key_id == key_id, "issued after the list was read: not refused"
    assert clock.sleeps == [pytest.approx(0.75)], "the list is read again at most once a second"
    assert counting.lists == 2
    assert directory.principal(fresh).key_id == key_id and counting.lists == 2


def test_a_flood_of_random_keys_costs_one_query_a_second_and_evicts_no_valid_key(sqlite_store: KeyStore) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=1000.0, clock=clock, max_entries=3, max_misses=50,
                                sleep=clock.sleep)
    counting = Counting(sqlite_store)
    valid = [sqlite_store.create_key(f"team-{i}")[1] for i in range(3)]
    for key in valid:
        directory.principal(key)
    assert (counting.calls, counting.lists) == (3, 1)

    started = clock.now
    for _ in range(200):
        clock.advance(0.01)
        with pytest.raises(Unauthorized):
            directory.principal(new_key()[1])
    assert counting.calls == 3, "no random key is looked up on its own"
    assert counting.lists - 1 <= math.ceil(clock.now - started), "at most one read of the key list a second"
    assert max(clock.sleeps) <= 1.0, "and none waits longer than a second for it"
    assert len(directory._misses) == 50 and len(directory._principals) == 3, "refusals are bounded on their own"
    for key in valid:
        directory.principal(key)
    assert counting.calls == 3, "every valid key is still cached"

    key_id = key_id_of(valid[0])
    forged = f"llmb_{key_id}_{'x' * 43}"  # key ids are public: a guess at one costs no query either
    lists = counting.lists
    with pytest.raises(Unauthorized):
        directory.principal(forged)
    assert counting.calls == 3 and counting.lists == lists


def test_a_database_outage_serves_what_was_seen_and_503s_the_rest(sqlite_store: KeyStore,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=5.0, clock=clock)
    key_id, key = sqlite_store.create_key("team-a")
    _, unknown = new_key()
    sqlite_store.set_tenant("team-a", weight=2)
    seen = directory.principal(key)
    with pytest.raises(Unauthorized):
        directory.principal(unknown)
    assert directory.policy("team-a").weight == 2

    healthy = sqlite_store.engine
    sqlite_store.engine = make_engine(UNREACHABLE)
    clock.advance(60)
    with caplog.at_level(logging.WARNING, logger="llmb.tenants"):
        assert directory.principal(key) == seen, "a known key keeps working on its last answer"
    assert "database unreachable" in caplog.text
    with pytest.raises(Unauthorized):
        directory.principal(unknown)
    with pytest.raises(Unavailable):
        directory.principal(new_key()[1])
    assert directory.policy("team-a").weight == 2
    # without keys nothing needs the database to be safe: an unseen tenant is served with the defaults
    assert directory.policy("team-b") == replace(sqlite_store.defaults, name="team-b")

    sqlite_store.engine = healthy
    sqlite_store.revoke(key_id)
    clock.advance(0.5)
    assert directory.principal(key) == seen, "while one caller refreshes, the others keep the last answer"
    clock.advance(1)
    with pytest.raises(Unauthorized):
        directory.principal(key)


def test_the_caches_are_bounded(sqlite_store: KeyStore) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=60.0, clock=clock, max_entries=3, sleep=clock.sleep)
    counting = Counting(sqlite_store)
    keys = [sqlite_store.create_key(f"team-{i}")[1] for i in range(5)]
    for key in keys:
        directory.principal(key)
    assert len(directory._principals) == 3 and counting.calls == 5
    directory.principal(keys[-1])
    assert counting.calls == 5, "the newest stay"
    directory.principal(keys[0])
    assert counting.calls == 6, "the oldest went"


def test_tenant_policies_are_cached_and_names_checked(sqlite_store: KeyStore) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=5.0, clock=clock)
    assert directory.policy("team-a") == TenantPolicy("team-a", 1.0, 100, Priority.INTERACTIVE)
    sqlite_store.set_tenant("team-a", priority="offline")
    assert directory.policy("team-a").priority is Priority.INTERACTIVE
    clock.advance(5)
    assert directory.policy("team-a").priority is Priority.OFFLINE
    with pytest.raises(InvalidInput):
        directory.policy("not a tenant")


def test_the_class_a_caller_is_cached_with_is_known_without_a_query(sqlite_store: KeyStore) -> None:
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=5.0, clock=clock)
    sqlite_store.set_tenant("batchy", priority="offline")
    key_id, key = sqlite_store.create_key("batchy")
    assert directory.cached_priority(None, "batchy") is None  # not looked up yet: not known
    assert directory.cached_priority(key, "") is None
    directory.policy("batchy")
    directory.principal(key)
    assert directory.cached_priority(None, "batchy") is Priority.OFFLINE
    assert directory.cached_priority(key, "") is Priority.OFFLINE
    assert directory.cached_priority(key + "x", "") is None  # another key is not this one
    clock.advance(5)
    assert directory.cached_priority(None, "batchy") is None  # stale: the next call looks it up again
    # a key's class is known past its lookup's TTL: the key index holds it (loaded for that lookup)
    assert directory.cached_priority(key, "") is Priority.OFFLINE
    sqlite_store.revoke(key_id)
    loads = directory._index.loads
    directory.refresh_index()  # as each API process does every TTL: loaded again, without the revoked key
    assert directory._index.loads == loads + 1 and directory.cached_priority(key, "") is None
    directory.refresh_index()  # within the TTL of that load: nothing
    assert directory._index.loads == loads + 1


def test_a_key_issued_while_no_call_came_is_known_after_the_next_refresh(sqlite_store: KeyStore) -> None:
    """The door places a call on arrival only by what memory holds: a key issued after the index was loaded is
    known once the process's refresh (every TTL, between calls) has loaded it, with its tenant's class."""
    clock = FakeClock(start=1000.0)
    directory = TenantDirectory(sqlite_store, ttl_s=5.0, clock=clock)
    directory.refresh_index()
    _, key = sqlite_store.create_key("late")
    assert directory.cached_priority(key, "") is None and directory.known_caller(key) is None
    clock.advance(5)
    directory.refresh_index()
    assert directory.cached_priority(key, "") is Priority.INTERACTIVE
    assert directory.known_caller(key) == f"key {key_id_of(key)}"


# -- llmb-admin -----------------------------------------------------------------------------------------
@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    admin(url, "db", "upgrade")
    return url


def test_cli_keys_create_prints_the_key_alone(sqlite_url: str) -> None:
    done = admin(sqlite_url, "keys", "create", "team-a", "--label", "ci bot")
    key = done.stdout.strip()
    assert done.stdout == key + "\n" and KEY_FORMAT.match(key)
    key_id = key.split("_")[1]
    assert key_id in done.stderr and "only once" in done.stderr
    principal = store_for(sqlite_url).authenticate(key)
    assert principal is not None and principal.key_id == key_id and not principal.admin
    admin_key = admin(sqlite_url, "keys", "create", "ops", "--admin").stdout.strip()
    assert (p := store_for(sqlite_url).authenticate(admin_key)) is not None and p.admin

    bad = admin(sqlite_url, "keys", "create", "no spaces", check=False)
    assert bad.returncode != 0 and "tenant name" in bad.stderr and bad.stdout == ""


def test_cli_keys_list_and_revoke(sqlite_url: str) -> None:
    key = admin(sqlite_url, "keys", "create", "team-a", "--label", "ci bot").stdout.strip()
    admin(sqlite_url, "keys", "create", "team-b")
    key_id = key.split("_")[1]
    listed = admin(sqlite_url, "keys", "list", "--json").stdout
    assert key not in listed and hash_key(key) not in listed and key.split("_", 2)[2] not in listed
    rows = json.loads(listed)
    assert {r["tenant"] for r in rows} == {"team-a", "team-b"}
    assert all(set(r) == {"id", "tenant", "admin", "label", "created_at", "revoked_at"} for r in rows)
    only_a = json.loads(admin(sqlite_url, "keys", "list", "--tenant", "team-a", "--json").stdout)
    assert [(r["id"], r["label"], r["revoked_at"]) for r in only_a] == [(key_id, "ci bot", None)]
    assert key_id in admin(sqlite_url, "keys", "list").stdout

    assert key_id in admin(sqlite_url, "keys", "revoke", key_id).stdout
    assert store_for(sqlite_url).authenticate(key) is None
    assert json.loads(admin(sqlite_url, "keys", "list", "--tenant", "team-a", "--json").stdout)[0]["revoked_at"]
    again = admin(sqlite_url, "keys", "revoke", key_id, check=False)
    assert again.returncode != 0 and "already revoked" in again.stderr
    unknown = admin(sqlite_url, "keys", "revoke", "deadbeef", check=False)
    assert unknown.returncode != 0 and "deadbeef" in unknown.stderr


def test_cli_tenants_set_and_list(sqlite_url: str) -> None:
    out = admin(sqlite_url, "tenants", "set", "team-a", "--weight", "2", "--max-in-flight", "50",
                "--priority", "offline").stdout
    assert "team-a" in out and "weight=2" in out and "max_in_flight=50" in out and "priority=offline" in out
    admin(sqlite_url, "tenants", "set", "team-a", "--weight", "3")
    admin(sqlite_url, "keys", "create", "team-b")
    rows = json.loads(admin(sqlite_url, "tenants", "list", "--json").stdout)
    assert rows == [{"name": "team-a", "weight": 3.0, "max_in_flight": 50, "priority": "offline"},
                    {"name": "team-b", "weight": 1.0, "max_in_flight": 5000, "priority": "interactive"}]
    assert "team-b" in admin(sqlite_url, "tenants", "list").stdout
    for args in (["--weight", "0"], ["--max-in-flight", "0"], ["--priority", "urgent"]):
        assert admin(sqlite_url, "tenants", "set", "team-a", *args, check=False).returncode != 0


def test_cli_says_to_upgrade_a_database_without_the_tables(tmp_path: Path) -> None:
    done = admin(f"sqlite:///{tmp_path / 'empty.db'}", "keys", "list", check=False)
    assert done.returncode != 0 and "llmb-admin db upgrade" in done.stderr
    down = admin(UNREACHABLE, "keys", "create", "team-a", check=False)
    assert down.returncode != 0 and "cannot reach the database" in down.stderr and down.stdout == ""
