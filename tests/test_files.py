"""The Batch API's file store on a real folder and on SQLite and PostgreSQL: per-tenant quota (count and bytes),
expiry, and no orphan bytes whatever fails on the way (the database, the rename)."""
from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from tasks.errors import PayloadTooLarge, QuotaExceeded
from tasks.store.files import FileStore
from tasks.store.models import Base, FileRecord, make_engine
from tests.fakes import FakeClock
from webapp.errors import status_of


@pytest.fixture
def store(database_url: str, tmp_path: Path) -> FileStore:
    engine = make_engine(database_url)
    Base.metadata.create_all(engine)
    return FileStore(engine, tmp_path / "files", tenant_max_count=3, tenant_max_bytes=1000, expire_s=3600)


def save(store: FileStore, tenant: str, size: int, **kw: object) -> str:
    return store.save(tenant, "batch", "f.jsonl", io.BytesIO(b"x" * size), 10_000, **kw).id  # type: ignore[arg-type]


def names(store: FileStore) -> set[str]:
    return {p.name for p in store.root.iterdir()} if store.root.exists() else set()


def rows(store: FileStore) -> set[str]:
    with Session(store.engine) as session:
        return set(session.scalars(session.query(FileRecord.id).statement))


def test_a_tenant_holds_at_most_its_quota_of_files_and_bytes(store: FileStore) -> None:
    first, second = save(store, "a", 400), save(store, "a", 400)
    with pytest.raises(QuotaExceeded, match="LLMB_FILES_TENANT_MAX_BYTES") as over:
        save(store, "a", 300)  # 1,100 bytes: over as it arrives
    message = over.value.message
    assert status_of(over.value.type) == 403 and "800 bytes" in message and "DELETE /v1/files" in message
    assert names(store) == {first, second}, "nothing of the refused upload is left"
    third = save(store, "a", 200)
    with pytest.raises(QuotaExceeded, match="LLMB_FILES_TENANT_MAX_COUNT"):
        save(store, "a", 1)
    save(store, "b", 999)  # another tenant's quota is its own
    assert store.delete("a", first)
    save(store, "a", 1)
    assert store.usage("a").files == 3 and store.usage("a").bytes == 601
    with pytest.raises(PayloadTooLarge, match="LLMB_MAX_FILE_BYTES=10"):
        store.save("c", "batch", "f", io.BytesIO(b"x" * 11), 10)
    assert third in names(store) and not any(n.startswith(".upload-") for n in names(store))


def test_expired_files_are_not_found_not_listed_and_not_counted(store: FileStore) -> None:
    clock = FakeClock(start=time.time())
    store.clock = clock
    short, long = save(store, "a", 500), save(store, "a", 400, expires_s=7200)
    clock.advance(3601)
    assert store.get("a", short) is None and store.get("a", long) is not None
    assert [f.id for f in store.page("a")[0]] == [long] and store.usage("a").bytes == 400
    assert save(store, "a", 500), "the expired file's bytes no longer count"
    assert store.delete_expired() == 1 and short not in names(store) and short not in rows(store)


def test_no_bytes_outlive_an_upload_whose_row_cannot_be_committed(tmp_path: Path) -> None:
    broken = FileStore(make_engine(f"sqlite:///{tmp_path / 'no-tables.db'}"), tmp_path / "files")
    with pytest.raises(SQLAlchemyError):
        broken.save("a", "batch", "f.jsonl", io.BytesIO(b"x" * 5000), 10_000)
    assert names(broken) == set(), "neither the file nor its temporary name is left"
    with pytest.raises(SQLAlchemyError):
        broken.put("file-out", "a", "batch_output", "out.jsonl", [b"line\n"])
    assert names(broken) == set()


def test_a_rename_that_fails_after_the_commit_takes_its_row_back(store: FileStore,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="Input/output error"):
        save(store, "a", 10)
    assert names(store) == set() and rows(store) == set()
