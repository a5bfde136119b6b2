"""The quarantine survives a Redis restart: the ledger is the durable record, Redis the enforced copy.

Real Redis (a key prefix of each test's own) and real databases (SQLite and PostgreSQL, via ``database_url``).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from harness.admitting import try_admit
from harness.stack import REDIS_URL
from tasks.cli import cli
from tasks.schema import BatchItem, input_hash
from tasks.state.admission import Admission, AdmissionVerdict, Ticket
from tasks.state.quarantine import Quarantine, QuarantineSync
from tasks.store.ledger import Ledger, Quarantined
from tasks.store.models import make_engine
from tests.fakes import FakeClock


class CountingRedis(redis.Redis):
    """The real client, counting the commands it sends one by one (pipelines aside)."""

    commands: list[str]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]))
        return super().execute_command(*args, **options)


@pytest.fixture
def namespace() -> Iterator[str]:
    ns = f"test-quarantine-{uuid.uuid4().hex[:12]}"
    yield ns
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{ns}:*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def client() -> CountingRedis:
    c = CountingRedis.from_url(REDIS_URL)  # from_url is a classmethod: a CountingRedis, typed as a plain Redis
    assert isinstance(c, CountingRedis)
    c.commands = []
    return c


def admin(ns: str, url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--namespace", ns, "--redis-url", REDIS_URL, "--database-url", url, *args])


def migrated(ns: str, url: str) -> Ledger:
    done = admin(ns, url, "db", "upgrade")
    assert done.exit_code == 0, done.output
    return Ledger(make_engine(url), store_inputs=True)


def enforcement(ns: str, url: str) -> list[tuple[str, bool | None]]:
    listed = admin(ns, url, "quarantine", "list", "--json")
    assert listed.exit_code == 0, listed.output
    return [(e["hash"], e["enforced"]) for e in json.loads(listed.output)]


def poison(quarantine: Quarantine, ledger: Ledger, text: str) -> str:
    """Quarantine an input as :meth:`tasks.broker.recovery.Recovery._poison` does: Redis, then the ledger record."""
    item = BatchItem(id=uuid.uuid4().hex, request_id=f"corr-{uuid.uuid4().hex[:6]}", input=text,
                     deadline=time.time() + 30, accepted_at=time.time(), reply_to="c")
    digest = input_hash("sim", text)
    quarantine.add(digest, model="sim", reason="fails alone", batch_id="b1", request_id=item.request_id)
    ledger.write(Quarantined(digest, "sim", "fails alone", "b1", item))
    return digest


def redis_restarts(quarantine: Quarantine) -> None:
    """What a Redis without persistence has after a restart: none of the quarantine's keys."""
    quarantine.client.delete(quarantine.key, quarantine.info_key, quarantine.loaded_key)


def refused_at_the_door(client: redis.Redis, ns: str, digest: str) -> bool:
    admission = Admission(client, f"{ns}:inflight", 100, f"{ns}:quarantine")
    item = uuid.uuid4().hex
    verdict, *_ = try_admit(admission, [item], [digest], ticket=Ticket("t", "sim"), now=time.time(), timeout_s=30)
    if verdict is AdmissionVerdict.OK:
        admission.release(Ticket("t", "sim"), [item])
    return verdict is AdmissionVerdict.QUARANTINED


def test_a_restarted_redis_gets_the_quarantine_back_from_the_ledger(database_url: str, namespace: str,
                                                                    client: CountingRedis) -> None:
    ledger = migrated(namespace, database_url)
    quarantine = Quarantine(client, f"{namespace}:quarantine")
    sync = QuarantineSync(quarantine, ledger)
    assert sync.tick() and sync.join(10)  # first start: the (empty) ledger is loaded, the marker set
    kept, released = poison(quarantine, ledger, "kills the model"), poison(quarantine, ledger, "fixed since")
    done = admin(namespace, database_url, "quarantine", "release", released)
    assert done.exit_code == 0, done.output

    redis_restarts(quarantine)
    assert not quarantine.contains(kept) and not refused_at_the_door(client, namespace, kept)

    assert sync.tick(), "a missing marker starts a reload"
    assert sync.join(10) and sync.reloads == 2
    assert quarantine.contains(kept) and refused_at_the_door(client, namespace, kept)
    assert not quarantine.contains(released) and not refused_at_the_door(client, namespace, released)
    assert [e["hash"] for e in quarantine.list()] == [kept]
    assert quarantine.list()[0]["reason"] == "fails alone" and quarantine.list()[0]["model"] == "sim"

    client.commands.clear()
    for _ in range(5):
        assert not sync.tick()
    assert client.commands == ["EXISTS"] * 5, "with nothing lost, a tick is one EXISTS"


def test_quarantine_list_and_release_work_from_the_ledger_when_redis_lost_it(database_url: str, namespace: str,
                                                                             client: CountingRedis) -> None:
    ledger = migrated(namespace, database_url)
    quarantine = Quarantine(client, f"{namespace}:quarantine")
    digest = poison(quarantine, ledger, "poison")
    assert enforcement(namespace, database_url) == [(digest, True)]

    redis_restarts(quarantine)
    assert enforcement(namespace, database_url) == [(digest, False)]  # from the ledger: known, not enforced
    assert "NOT ENFORCED" in admin(namespace, database_url, "quarantine", "list").output

    done = admin(namespace, database_url, "quarantine", "release", digest)  # only the ledger still holds it
    assert done.exit_code == 0, done.output
    again = admin(namespace, database_url, "quarantine", "release", digest)
    assert again.exit_code == 1 and "not quarantined" in again.output
    QuarantineSync(quarantine, ledger).reload()
    assert not quarantine.contains(digest)
    assert admin(namespace, database_url, "quarantine", "list").output.strip() == "no input is quarantined"


def test_an_input_quarantined_after_the_restart_is_kept_by_the_reload(database_url: str, namespace: str,
                                                                      client: CountingRedis) -> None:
    ledger = migrated(namespace, database_url)
    quarantine = Quarantine(client, f"{namespace}:quarantine")
    old = poison(quarantine, ledger, "old")
    redis_restarts(quarantine)
    new = input_hash("sim", "new")  # in Redis already, its ledger record still in a writer's buffer
    quarantine.add(new, model="sim", reason="fresh", batch_id="b2", request_id="r2")
    assert QuarantineSync(quarantine, ledger).reload() == 1
    assert quarantine.contains(old) and quarantine.contains(new) and quarantine.is_loaded()
    assert {e["hash"]: e["reason"] for e in quarantine.list()} == {old: "fails alone", new: "fresh"}


def test_a_reload_that_cannot_reach_the_ledger_is_tried_again_later(namespace: str,
                                                                    client: CountingRedis) -> None:
    clock = FakeClock(start=100.0)
    quarantine = Quarantine(client, f"{namespace}:quarantine")
    away = Ledger(make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none"))
    sync = QuarantineSync(quarantine, away, retry_s=5.0, clock=clock)
    assert sync.tick() and sync.join(10)
    assert not quarantine.is_loaded() and sync.reloads == 0
    clock.advance(4.0)
    assert not sync.tick(), "no new attempt before retry_s"
    clock.advance(1.5)
    assert sync.tick() and sync.join(10)
    assert not quarantine.is_loaded()
