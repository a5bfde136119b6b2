"""The LoRA adapter registry (issue 44) without a running system: the PEFT directory's checks, the table on SQLite
and PostgreSQL (names, conflicts, the bound flooded), the catalog's cache with a fake clock, the resolution of a
call's model, the ledger's adapter column and the CLI."""
from __future__ import annotations

import json
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import inspect, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from harness.adapters import write_lora
from harness.stack import BIN, ROOT
from tasks.cli import cli
from tasks.errors import AdapterConflict, AdapterLimit, InvalidInput, ModelNotFound, Unavailable
from tasks.gateway.calls import Call
from tasks.schema import BatchItem, SamplingParams
from tasks.store.adapters import Adapter, AdapterCatalog, AdapterStore, peft_rank
from tasks.store.ledger import ItemsOutcome, Ledger
from tasks.store.models import Base, RequestRecord, make_engine
from tests.fakes import FakeClock
from webapp.adapter_names import resolve, shown_model
from webapp.errors import STATUSES


def admin(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BIN / "llmb-admin"), "--database-url", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def lora(tmp_path: Path) -> Path:
    return write_lora(tmp_path / "lora", rank=8)


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    url = f"sqlite:///{tmp_path / 'db'}"
    Base.metadata.create_all(make_engine(url))
    return AdapterStore(make_engine(url), max_adapters=5)


# -- the PEFT directory ---------------------------------------------------------------------------------------
def test_a_peft_directory_gives_its_rank_and_a_broken_one_says_what_is_missing(tmp_path: Path, lora: Path) -> None:
    assert peft_rank(str(lora)) == 8
    bin_only = write_lora(tmp_path / "bin", rank=4)
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    assert peft_rank(str(bin_only)) == 4
    cases: list[tuple[Path, str]] = [(tmp_path / "absent", "not a directory")]
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((empty, "adapter_config.json"))
    for name, config, why in (("bad-json", "{", "JSON"), ("list", "[]", "JSON object"),
                              ("no-r", json.dumps({"peft_type": "LORA"}), "'r'"),
                              ("bool-r", json.dumps({"r": True}), "'r'"), ("zero-r", json.dumps({"r": 0}), "'r'"),
                              ("prefix", json.dumps({"peft_type": "PREFIX_TUNING", "r": 8}), "only LoRA")):
        folder = write_lora(tmp_path / name)
        (folder / "adapter_config.json").write_text(config)
        cases.append((folder, why))
    no_weights = write_lora(tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    cases.append((no_weights, "no weights"))
    for folder, why in cases:
        with pytest.raises(InvalidInput, match=why):
            peft_rank(str(folder))


# -- the table ------------------------------------------------------------------------------------------------
def test_the_migration_matches_the_models_and_the_adapters_table_round_trips(database_url: str, lora: Path) -> None:
    admin(database_url, "db", "upgrade")
    engine = make_engine(database_url)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    store = AdapterStore(engine, max_adapters=10)
    shared = store.add("team-a/sql", "sim-lm", str(lora))
    private = store.add("b-tone", "sim-lm", str(lora), tenant="team-b", pinned=True)
    assert (shared.tenant, shared.pinned, shared.rank, shared.path) == (None, False, 8, str(lora))
    assert store.get("b-tone") == private and private.created_at.tzinfo is not None
    assert [a.name for a in store.list()] == ["b-tone", "team-a/sql"]
    assert [a.name for a in store.list("team-a")] == ["team-a/sql"]  # its own and the shared ones
    assert [a.name for a in store.list("team-b")] == ["b-tone", "team-a/sql"]
    assert store.remove("b-tone") and not store.remove("b-tone") and store.get("b-tone") is None
    admin(database_url, "db", "downgrade", "0008")
    assert "adapters" not in inspect(make_engine(database_url)).get_table_names()
    assert "adapter" not in {c["name"] for c in inspect(make_engine(database_url)).get_columns("requests")}


def test_a_name_is_one_thing_only(store: AdapterStore, lora: Path) -> None:
    store.add("sql", "sim-lm", str(lora))
    with pytest.raises(AdapterConflict, match="registered already"):
        store.add("sql", "other", str(lora))
    with pytest.raises(AdapterConflict, match="serves"):
        store.add("tiny-llama", "sim-lm", str(lora), served={"sim-lm", "tiny-llama"})
    with pytest.raises(AdapterConflict, match="base model"):
        store.add("sim-lm", "sim-lm", str(lora))
    for name, base, tenant in (("a:b", "sim-lm", None), ("", "sim-lm", None), ("x" * 129, "sim-lm", None),
                               ("ok", "bad base", None), ("ok", "sim-lm", "no tenant!")):
        with pytest.raises(InvalidInput):
            store.add(name, base, str(lora), tenant=tenant)
    assert [a.name for a in store.list()] == ["sql"]
    assert STATUSES[AdapterConflict.type] == 409 and STATUSES[AdapterLimit.type] == 403


def test_a_flood_of_registrations_stops_at_the_bound(store: AdapterStore, lora: Path) -> None:
    for i in range(5):
        store.add(f"a{i}", "sim-lm", str(lora))
    for i in range(5, 50):
        with pytest.raises(AdapterLimit, match="LLMB_MAX_REGISTERED_ADAPTERS"):
            store.add(f"a{i}", "sim-lm", str(lora))
    assert len(store.list()) == 5
    assert store.remove("a0")
    store.add("a5", "sim-lm", str(lora))  # room again
    assert len(store.list()) == 5


# -- the catalog and the resolution ---------------------------------------------------------------------------
def adapter(name: str, tenant: str | None = None, base: str = "sim-lm") -> Adapter:
    from datetime import UTC, datetime
    return Adapter(name, base, f"/adapters/{name}", 8, tenant, name.endswith("pinned"), datetime.now(UTC))


class Table:
    """The rows a catalog reads; ``down`` makes the next read fail as an unreachable database does."""

    def __init__(self, rows: list[Adapter]) -> None:
        self.rows, self.down, self.reads = rows, False, 0

    def __call__(self) -> list[Adapter]:
        self.reads += 1
        if self.down:
            raise OperationalError("select", {}, Exception("connection refused"))
        return list(self.rows)


GENERATION = SamplingParams(max_tokens=4)


def call(model: str, tenant: str = "team-a", params: SamplingParams = GENERATION) -> Call:
    return Call(request_id=uuid.uuid4().hex, tenant=tenant, model=model, inputs=("hi",), timeout_ms=1000,
                params=params)


def test_the_catalog_reads_the_table_once_per_ttl_and_serves_the_last_reading_while_the_database_is_down() -> None:
    clock = FakeClock()
    table = Table([adapter("shared"), adapter("mine", "team-a")])
    catalog = AdapterCatalog(table, ttl_s=2.0, clock=clock)
    for _ in range(100):
        assert catalog.find("shared", "team-b") is not None
    assert table.reads == 1
    assert catalog.find("mine", "team-a") is not None and catalog.find("mine", "team-b") is None
    table.rows = [adapter("shared")]  # "mine" removed: it stops resolving once the TTL has passed
    clock.advance(1.0)
    assert catalog.find("mine", "team-a") is not None
    clock.advance(1.5)
    assert catalog.find("mine", "team-a") is None and table.reads == 2
    table.rows = [adapter("shared"), adapter("new")]
    catalog.refresh()  # this process registered one: read at once, whatever the TTL
    assert catalog.find("new", "team-b") is not None and table.reads == 3
    table.down = True
    clock.advance(5)
    assert catalog.find("shared", "team-a") is not None and not catalog.unreadable  # the last reading
    catalog.refresh()
    assert catalog.find("new", "team-a") is not None  # a failed re-read keeps the last reading too
    assert [a.name for a in AdapterCatalog(Table([adapter("x", "t"), adapter("y")]), 1.0, clock).usable("u")] == ["y"]


def test_a_call_naming_an_adapter_becomes_a_call_of_its_base_with_the_adapter_in_its_params() -> None:
    catalog = AdapterCatalog(Table([adapter("sql-pinned"), adapter("mine", "team-a", base="tiny")]), 2.0, FakeClock())
    served = {"sim-lm", "tiny"}.copy
    out = resolve(call("sql-pinned"), catalog, served)
    assert out.model == "sim-lm" and shown_model(out) == "sql-pinned"
    assert (out.params.adapter, out.params.adapter_path, out.params.adapter_pinned) == (
        "sql-pinned", "/adapters/sql-pinned", True)
    assert out.params.max_tokens == 4  # the rest of the params as they were
    wire = out.params.to_dict()
    assert SamplingParams.from_dict(wire) == out.params and wire["adapter"] == "sql-pinned"
    native = resolve(call("mine", params=SamplingParams()), catalog, served)  # /v1/infer: no params of its own
    assert native.model == "tiny" and native.params.to_dict() == {"adapter": "mine", "adapter_path": "/adapters/mine"}
    for model, tenant in (("sim-lm", "team-a"), ("unknown", "team-a"), ("mine", "team-b")):
        unchanged = call(model, tenant)
        assert resolve(unchanged, catalog, served) == unchanged and shown_model(unchanged) == model


def test_while_the_registry_was_never_readable_a_name_not_served_is_a_503_not_a_404() -> None:
    table, clock = Table([adapter("sql")]), FakeClock()
    table.down = True
    catalog = AdapterCatalog(table, 2.0, clock, retry_s=1.0)
    assert resolve(call("sim-lm"), catalog, lambda: {"sim-lm"}).model == "sim-lm"  # base models go on
    for i in range(100):  # a flood of made-up names: one read of the table per retry_s, however many
        with pytest.raises(Unavailable):
            resolve(call(f"made-up-{i}"), catalog, lambda: {"sim-lm"})
    assert table.reads == 1 and catalog.unreadable
    assert not issubclass(Unavailable, ModelNotFound)
    table.down = False
    clock.advance(1.0)
    assert resolve(call("sql"), catalog, lambda: {"sim-lm"}).params.adapter == "sql" and table.reads == 2


# -- the ledger -----------------------------------------------------------------------------------------------
def test_the_ledger_records_each_items_adapter(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    Base.metadata.create_all(make_engine(url))
    ledger = Ledger(make_engine(url))
    params = SamplingParams(max_tokens=4, adapter="sql", adapter_path="/adapters/sql")
    items = [BatchItem(id="with", request_id="r1", input="x", deadline=0, accepted_at=0, reply_to="q", params=params),
             BatchItem(id="without", request_id="r2", input="x", deadline=0, accepted_at=0, reply_to="q")]
    ledger.write(ItemsOutcome("sim-lm", items, "expired"))
    with Session(make_engine(url)) as s:
        rows = {r.id: r for r in s.scalars(select(RequestRecord))}
    assert rows["with"].adapter == "sql" and rows["without"].adapter is None
    assert rows["with"].model == "sim-lm" and json.loads(rows["with"].params or "{}")["adapter_path"] == "/adapters/sql"


# -- the CLI --------------------------------------------------------------------------------------------------
def test_the_cli_adds_lists_and_removes_adapters(tmp_path: Path, lora: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    Base.metadata.create_all(make_engine(url))
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> str:
        done = runner.invoke(cli, ["--database-url", url, "--namespace", f"t{uuid.uuid4().hex[:8]}", *args],
                             env={"LLMB_MAX_REGISTERED_ADAPTERS": "2"})
        assert done.exit_code == code, done.output
        return done.output

    assert "registered sql: base sim-lm, rank 8, every tenant" in run("adapters", "add", "sql", "--base", "sim-lm",
                                                                     "--path", str(lora))
    assert "tenant team-b, pinned" in run("adapters", "add", "tone", "--base", "sim-lm", "--path", str(lora),
                                          "--tenant", "team-b", "--pin")
    assert "LLMB_MAX_REGISTERED_ADAPTERS" in run("adapters", "add", "third", "--base", "sim-lm", "--path",
                                                 str(lora), code=1)
    assert "registered already" in run("adapters", "add", "sql", "--base", "sim-lm", "--path", str(lora), code=1)
    assert "holds no" in run("adapters", "add", "x", "--base", "sim-lm", "--path", str(tmp_path), code=1)
    listed = json.loads(run("adapters", "list", "--json"))
    assert [(a["name"], a["tenant"], a["pinned"], a["rank"]) for a in listed] == [
        ("sql", None, False, 8), ("tone", "team-b", True, 8)]
    assert [a["name"] for a in json.loads(run("adapters", "list", "--tenant", "team-a", "--json"))] == ["sql"]
    table = run("adapters", "list")
    assert "sql" in table and "(all)" in table and str(lora) in table
    assert "removed tone" in run("adapters", "remove", "tone")
    assert "no adapter named 'tone'" in run("adapters", "remove", "tone", code=1)
    assert [a["name"] for a in json.loads(run("adapters", "list", "--json"))] == ["sql"]


def test_concurrent_registrations_never_pass_the_bound(database_url: str, lora: Path) -> None:
    admin(database_url, "db", "upgrade")
    store = AdapterStore(make_engine(database_url), max_adapters=5)

    def register(i: int) -> str:
        try:
            store.add(f"flood-{i}", "sim-lm", str(lora))
            return "ok"
        except AdapterLimit:
            return "limit"

    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(register, range(40)))
    assert outcomes.count("ok") == 5 and outcomes.count("limit") == 35
    assert len(store.list()) == 5
