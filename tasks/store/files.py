"""The Batch API's files: their bytes in a folder (``LLMB_FILES_DIR``), what is known of them in the ``files`` table.

A file's bytes are written to a temporary name, flushed to disk and renamed into place before its row is
committed, so a file that has a row always has its whole content; a crash in between leaves a stray temporary
file and no row. Every lookup is scoped to a tenant: another tenant's file is not found. Output files (written by
a job) have fixed ids (:func:`tasks.policy.batchfile.output_file_id`): writing one again after a crash replaces
it, whole.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from tasks.config import Settings
from tasks.errors import PayloadTooLarge
from tasks.policy.batchfile import new_id
from tasks.store.models import FileRecord, make_engine

FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,58}$")
CHUNK = 1024 * 1024


@dataclass(frozen=True)
class FileInfo:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime

    def to_openai(self) -> dict[str, object]:
        """OpenAI's File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at.timestamp()),
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def _info(r: FileRecord) -> FileInfo:
    created = r.created_at if r.created_at.tzinfo else r.created_at.replace(tzinfo=timezone.utc)
    return FileInfo(r.id, r.tenant, r.purpose, r.filename, int(r.bytes), created)


class FileStore:
    def __init__(self, engine: Engine, root: Path) -> None:
        self.engine = engine
        self.root = root

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None) -> FileStore:
        return cls(engine or make_engine(settings.database_url), Path(settings.files_dir))

    def path(self, file_id: str) -> Path:
        """Where a file's bytes are (the id is checked: no path can be named through it)."""
        if not FILE_ID.match(file_id):
            raise KeyError(file_id)
        return self.root / file_id

    # -- writing ---------------------------------------------------------------------------------------
    def save(self, tenant: str, purpose: str, filename: str, source: IO[bytes], max_bytes: int) -> FileInfo:
        """Store an upload under a new id; PayloadTooLarge (nothing kept) beyond ``max_bytes``."""
        file_id = new_id("file-", datetime.now(timezone.utc).timestamp())

        def chunks() -> Iterable[bytes]:
            size = 0
            while chunk := source.read(CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLarge(f"the file is larger than {max_bytes} bytes (LLMB_MAX_FILE_BYTES)")
                yield chunk

        return self.put(file_id, tenant, purpose, filename, chunks())

    def put(self, file_id: str, tenant: str, purpose: str, filename: str, chunks: Iterable[bytes]) -> FileInfo:
        """Write ``chunks`` as file ``file_id`` (replacing it whole if it exists), then commit its row."""
        target = self.path(file_id)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        record = FileRecord(id=file_id, tenant=tenant, purpose=purpose, filename=filename[:255], bytes=size,
                            created_at=datetime.now(timezone.utc))
        with Session(self.engine) as session, session.begin():
            session.merge(record)
        return FileInfo(file_id, tenant, purpose, record.filename, size, record.created_at)

    def delete(self, tenant: str, file_id: str) -> bool:
        """Remove the tenant's file (row first, then its bytes); False when it has none of that id."""
        with Session(self.engine) as session, session.begin():
            done = session.execute(delete(FileRecord).where(FileRecord.id == file_id, FileRecord.tenant == tenant))
            if not done.rowcount:  # type: ignore[attr-defined]
                return False
        self.path(file_id).unlink(missing_ok=True)
        return True

    # -- reading ---------------------------------------------------------------------------------------
    def get(self, tenant: str | None, file_id: str) -> FileInfo | None:
        """The file, if it is ``tenant``'s (None: anyone's)."""
        if not FILE_ID.match(file_id):
            return None
        with Session(self.engine) as session:
            r = session.get(FileRecord, file_id)
            return _info(r) if r is not None and tenant in (None, r.tenant) else None

    def open(self, file_id: str) -> IO[bytes]:
        return self.path(file_id).open("rb")

    def page(self, tenant: str, *, purpose: str | None = None, limit: int = 20, after: str | None = None,
             newest_first: bool = True) -> tuple[list[FileInfo], bool]:
        """A page of the tenant's files, and whether more follow."""
        f = FileRecord
        query = select(f).where(f.tenant == tenant).order_by(f.id.desc() if newest_first else f.id).limit(limit + 1)
        if purpose:
            query = query.where(f.purpose == purpose)
        if after:
            query = query.where(f.id < after if newest_first else f.id > after)
        with Session(self.engine) as session:
            rows = [_info(r) for r in session.scalars(query)]
        return rows[:limit], len(rows) > limit

    def copy_to(self, file_id: str, out: IO[bytes]) -> None:
        with self.open(file_id) as source:
            shutil.copyfileobj(source, out, CHUNK)
