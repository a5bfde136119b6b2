"""Who the door counts a call as, and the count itself, against hostile callers: a flood of random keys or names
costs O(1) per arrival and bounded memory, never moves the light-caller threshold, and spellings of one key are
one caller (a fake clock; the real tenant directory on SQLite)."""
from __future__ import annotations

import secrets
import time

from tasks.policy.callers import MAX_CALLERS, OTHERS, RecentCallers
from tasks.policy.shedding import Door
from tasks.store.directory import TenantDirectory
from tasks.store.tenants import KeyStore
from tests.fakes import FakeClock
from webapp.door import NAME_MAX, UNAUTHENTICATED, DoorIdentity, DoorMiddleware


def random_token() -> str:
    return f"Bearer llmb_{secrets.token_hex(4)}_{secrets.token_urlsafe(24)}"


def test_100000_distinct_callers_keep_the_table_bounded_and_each_arrival_flat() -> None:
    """Each arrival of a new caller, then the door's light check, as the door does: the table stays within its
    cap, and the last 10,000 arrivals cost about what the first did (the rebuilt set made it quadratic)."""
    clock = FakeClock(start=100.0)
    callers = RecentCallers(clock)
    chunks: list[float] = []
    for chunk in range(10):
        started = time.perf_counter()
        for i in range(10_000):
            name = f"caller-{chunk}-{i}"
            callers.arrived(name)
            callers.light(name)
            clock.advance(0.0002)  # 5,000 a second: the window holds 30,000 of them
        chunks.append(time.perf_counter() - started)
        assert len(callers) <= MAX_CALLERS
    assert callers.recent(OTHERS) > 20_000  # the names beyond the cap, counted as one caller
    assert max(chunks[1:]) < 3 * chunks[0] + 0.05, chunks


def test_a_steady_tenant_stays_light_beside_a_flood_of_unauthenticated_arrivals(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    store, directory = tenants
    _, key = store.create_key("steady")
    directory.principal(key)  # its first call was authenticated: its tenant is known
    identity = DoorIdentity(directory)
    clock = FakeClock(start=100.0)
    callers = RecentCallers(clock)
    for i in range(20_000):  # 2,000 random keys a second for 10 s, a call a second from the steady tenant
        callers.arrived(identity(random_token(), None))
        if i % 2_000 == 1_000:
            caller = identity(f"Bearer {key}", None)
            assert caller == "steady"
            callers.arrived(caller)
            assert callers.light(caller)
        clock.advance(0.0005)
    assert len(callers) == 2 and callers.recent(UNAUTHENTICATED) >= 10_000
    assert not callers.light(UNAUTHENTICATED)  # the flood is one heavy caller


def test_spellings_of_one_key_are_one_caller_and_unknown_keys_are_unauthenticated(
        tenants: tuple[KeyStore, TenantDirectory]) -> None:
    store, directory = tenants
    _, key = store.create_key("team-a")
    identity = DoorIdentity(directory)
    spellings = [f"Bearer {key}", f"bEaReR {key}", f"bearer    {key}  ", f"BEARER {key}\t"]
    assert {identity(spelling, None) for spelling in spellings} == {UNAUTHENTICATED}  # nothing loaded yet
    directory.principal(store.create_key("team-b")[1])  # another tenant's call loads the index of keys
    first = {identity(spelling, None) for spelling in spellings}
    assert first == {f"key {key.split('_')[1]}"}  # an active key no call has looked up yet: one name for it
    directory.principal(key)
    assert {identity(spelling, "other-tenant") for spelling in spellings} == {"team-a"}
    for hostile in (None, "", "Basic abc", "Bearer", "Bearer " + "x" * 20_000, key, f"Bearer {key}x",
                    "Bearer llmb_00000000_" + "x" * 20):
        assert identity(hostile, "team-a") == UNAUTHENTICATED, hostile  # X-Tenant names no one with keys


def test_without_keys_the_named_tenant_counts_trimmed_and_cut_to_a_names_length() -> None:
    identity = DoorIdentity()
    assert identity("Bearer whatever", " team-a ") == "team-a"
    assert identity(None, "t" * 10_000) == "t" * NAME_MAX
    assert identity(None, None) == ""


def test_a_steady_tenant_stays_light_beside_a_flood_of_random_names() -> None:
    """Without keys a caller names itself: a flood of names fills the table, and the names beyond it count as
    one caller, so a tenant counted before the flood keeps its entry and stays light."""
    clock = FakeClock(start=100.0)
    callers = RecentCallers(clock, max_callers=100)
    callers.arrived("steady")
    for i in range(50_000):
        callers.arrived(f"random-{i}")
        if i % 1_000 == 500:
            callers.arrived("steady")
            assert callers.light("steady")
        clock.advance(0.0002)
    assert len(callers) <= 100 and callers.recent("steady") >= 5 and not callers.light(OTHERS)
    assert not callers.light("a-new-name")  # counted with the others while the table is full


def test_the_door_in_front_of_flask_counts_the_keys_tenant(tenants: tuple[KeyStore, TenantDirectory]) -> None:
    """Through :class:`DoorMiddleware`: spellings of one key are its tenant, random keys one caller."""
    store, directory = tenants
    _, key = store.create_key("team-a")
    directory.principal(key)
    door = Door(limit=1_000, retry_after_s=1)
    app = DoorMiddleware(lambda environ, start_response: [b"ok"], door, lambda path: True, DoorIdentity(directory))
    for header in [f"Bearer {key}", f"bEaReR  {key} ", *(random_token() for _ in range(500))]:
        list(app({"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/infer", "HTTP_AUTHORIZATION": header},
                 lambda status, headers, exc_info=None: lambda data: None))
    assert len(door.callers) == 2 and door.callers.recent("team-a") == 2
    assert door.callers.recent(UNAUTHENTICATED) == 500 and door.held == 0
