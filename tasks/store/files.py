"""The Batch API's files: their bytes in a folder (``LLMB_FILES_DIR``), what is known of them in the ``files`` table.

- **No orphan bytes.** A file's bytes go to a temporary name in the folder (``.upload-*``) and are flushed to
  disk; then its row is committed; then the temporary file is renamed into place. Any failure on the way (too
  large, over quota, disk full, the database away) removes the temporary file, and the row if it was committed.
  A process killed on the way leaves at most a temporary file, removed by :meth:`FileStore.sweep` once it is
  older than TEMP_MAX_AGE_S (and, killed between the commit and the rename, a row whose content answers 404 until
  it expires). Deleting removes the bytes first, then the row: a crash between leaves a row without bytes, which
  the next delete or the expiry removes, never bytes that no row names.
- **Quota.** A tenant holds at most ``LLMB_FILES_TENANT_MAX_COUNT`` files and ``LLMB_FILES_TENANT_MAX_BYTES``
  bytes (its uploads and its jobs' outputs, until deleted or expired); an upload over either is refused
  (403 ``quota_exceeded``) as soon as it is known: the count before a byte is read, the bytes as they arrive.
  Uploads running at once are each checked against what was committed before them, so together they may go
  over by at most what they carry. Job outputs are always written (a finished job's answers are never lost to
  a quota); they count against the next upload.
- **Expiry.** Every file has an ``expires_at`` (``expires_after`` on upload, seconds after its creation, as
  OpenAI's; by default ``LLMB_FILES_EXPIRE_S``); from then it is not found, and :meth:`FileStore.delete_expired`
  (run by ``llmb-jobs`` every ``LLMB_FILES_CLEANUP_S``) deletes its bytes and its row.
- **Disk full** (ENOSPC, EDQUOT) while writing is :class:`tasks.errors.StorageFull` (507), never a 500.

Every lookup is scoped to a tenant: another tenant's file is not found. Output files (written by a job) have fixed
ids (:func:`tasks.policy.batchfile.output_file_id`): writing one again after a crash replaces it, whole.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from sqlalchemy import ColumnElement, and_, delete, func, or_, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from tasks.config import Settings
from tasks.errors import PayloadTooLarge, QuotaExceeded, StorageFull
from tasks.policy.batchfile import new_id
from tasks.store.models import FileRecord, make_engine

FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,58}$")
CHUNK = 1024 * 1024
TEMP_PREFIX = ".upload-"
TEMP_MAX_AGE_S = 3600.0  # a temporary file this old belongs to no write still running (uploads are time-bound)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


QUOTA_HOW = "delete files it no longer needs (DELETE /v1/files/{id}) or wait for them to expire"


def file_too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the file is larger than {max_bytes} bytes (LLMB_MAX_FILE_BYTES={max_bytes}); split "
                           "it into several batches")


@contextmanager
def storage_errors(root: Path) -> Iterator[None]:
    """A full disk while writing in ``root`` as :class:`StorageFull`, with what to do about it."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        raise StorageFull(f"no space left for the file in the files folder ({os.strerror(exc.errno)}); try again "
                          "later, or ask the operator to free space in LLMB_FILES_DIR") from None


@dataclass(frozen=True)
class FileInfo:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime
    expires_at: datetime | None = None

    def to_openai(self) -> dict[str, object]:
        """OpenAI's File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at.timestamp()),
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": int(self.expires_at.timestamp()) if self.expires_at else None, "status_details": None}


@dataclass(frozen=True)
class Usage:
    """What a tenant's files take now (expired ones not counted)."""

    files: int
    bytes: int


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _info(r: FileRecord) -> FileInfo:
    created = _utc(r.created_at)
    assert created is not None
    return FileInfo(r.id, r.tenant, r.purpose, r.filename, int(r.bytes), created, _utc(r.expires_at))


class Sink:
    """A file being received: its bytes go to a temporary file in the store's folder and are counted against the
    limits as they arrive (a writable stream, as werkzeug's multipart parser wants one)."""

    def __init__(self, root: Path, max_bytes: int, quota_left: int | None, quota_message: str) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.quota_left = quota_left
        self.quota_message = quota_message
        self.size = 0
        root.mkdir(parents=True, exist_ok=True)
        with storage_errors(root):
            fd, name = tempfile.mkstemp(dir=root, prefix=TEMP_PREFIX)
        self.tmp = Path(name)
        self.file: IO[bytes] = os.fdopen(fd, "w+b")

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise file_too_large(self.max_bytes)
        if self.quota_left is not None and self.size > self.quota_left:
            raise QuotaExceeded(self.quota_message)
        with storage_errors(self.root):
            return self.file.write(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def read(self, size: int = -1) -> bytes:
        return self.file.read(size)

    def flush(self) -> None:
        pass  # the bytes are flushed (and synced) once, by finish()

    def close(self) -> None:
        pass  # closed by finish() or discard(), never by whoever else holds it

    def finish(self) -> None:
        """Every byte on disk (flushed and synced), the file closed: ready to be named."""
        with storage_errors(self.root):
            self.file.flush()
            os.fsync(self.file.fileno())
        self.file.close()

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class FileStore:
    def __init__(self, engine: Engine, root: Path, clock: Callable[[], float] = time.time, *, expire_s: int = 0,
                 tenant_max_bytes: int = 0, tenant_max_count: int = 0) -> None:
        self.engine = engine
        self.root = Path(root).absolute()  # the settings made it absolute already; a store made by hand too
        self.clock = clock  # epoch seconds (expiry is compared across hosts)
        self.expire_s = expire_s  # default expiry of a new file (0: never)
        self.tenant_max_bytes = tenant_max_bytes  # 0: no quota
        self.tenant_max_count = tenant_max_count

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None,
                      clock: Callable[[], float] | None = None) -> FileStore:
        return cls(engine or make_engine(settings.stores.database_url), Path(settings.jobs.files_dir),
                   clock or time.time,
                   expire_s=settings.jobs.files_expire_s, tenant_max_bytes=settings.jobs.files_tenant_max_bytes,
                   tenant_max_count=settings.jobs.files_tenant_max_count)

    def path(self, file_id: str) -> Path:
        """Where a file's bytes are (the id is checked: no path can be named through it)."""
        if not FILE_ID.match(file_id):
            raise KeyError(file_id)
        return self.root / file_id

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), tz=UTC)

    def _expires_at(self, created: datetime, expires_s: int | None) -> datetime | None:
        seconds = self.expire_s if expires_s is None else expires_s
        return datetime.fromtimestamp(created.timestamp() + seconds, tz=UTC) if seconds > 0 else None

    @staticmethod
    def _live(now: datetime) -> ColumnElement[bool]:
        return or_(FileRecord.expires_at.is_(None), FileRecord.expires_at > now)

    # -- writing ---------------------------------------------------------------------------------------
    def usage(self, tenant: str) -> Usage:
        f = FileRecord
        with Session(self.engine) as session:
            n, size = session.execute(select(func.count(), func.coalesce(func.sum(f.bytes), 0))
                                      .where(f.tenant == tenant, self._live(self._now()))).one()
        return Usage(int(n), int(size))

    def receive(self, tenant: str, max_bytes: int) -> Sink:
        """A sink for a new upload of ``tenant``: QuotaExceeded at once when the tenant holds as many files as it
        may, or as it is written when it takes the tenant over its bytes; PayloadTooLarge beyond ``max_bytes``."""
        used, held = self._count_checked(tenant)
        quota_left = max(0, self.tenant_max_bytes - used.bytes) if self.tenant_max_bytes else None
        message = (f"{held}: this upload would take it over its quota of {self.tenant_max_bytes} bytes "
                   f"(LLMB_FILES_TENANT_MAX_BYTES); {QUOTA_HOW}")
        return Sink(self.root, max_bytes, quota_left, message)

    def check_quota(self, tenant: str) -> None:
        """QuotaExceeded when ``tenant`` holds as many files, or as many bytes, as its quota allows: a new batch
        is refused then, as an upload is (its output and error files would add to them)."""
        used, held = self._count_checked(tenant)
        if self.tenant_max_bytes and used.bytes >= self.tenant_max_bytes:
            raise QuotaExceeded(f"{held}: its quota is {self.tenant_max_bytes} bytes "
                                f"(LLMB_FILES_TENANT_MAX_BYTES); {QUOTA_HOW}")

    def _count_checked(self, tenant: str) -> tuple[Usage, str]:
        """The tenant's usage and its words; QuotaExceeded when it holds as many files as it may."""
        used = self.usage(tenant) if self.tenant_max_count or self.tenant_max_bytes else Usage(0, 0)
        held = f"tenant {tenant!r} holds {used.files} file(s) of {used.bytes} bytes"
        if self.tenant_max_count and used.files >= self.tenant_max_count:
            raise QuotaExceeded(f"{held}: its quota is {self.tenant_max_count} files "
                                f"(LLMB_FILES_TENANT_MAX_COUNT); {QUOTA_HOW}")
        return used, held

    def commit(self, sink: Sink, tenant: str, purpose: str, filename: str, expires_s: int | None = None,
               file_id: str | None = None) -> FileInfo:
        """Name the bytes a sink received: flushed, the row committed, then renamed into place (see the module's
        docstring). The sink is used up, whatever happens."""
        file_id = file_id or new_id("file-", self.clock())
        target = self.path(file_id)
        created = self._now()
        record = FileRecord(id=file_id, tenant=tenant, purpose=purpose, filename=filename[:255], bytes=sink.size,
                            created_at=created, expires_at=self._expires_at(created, expires_s))
        committed = False
        try:
            sink.finish()
            with Session(self.engine) as session, session.begin():
                session.merge(record)
            committed = True
            os.replace(sink.tmp, target)
        except BaseException:
            sink.discard()
            if committed:
                self._forget(file_id)
            raise
        return FileInfo(file_id, tenant, purpose, record.filename, sink.size, created, _utc(record.expires_at))

    def _forget(self, file_id: str) -> None:
        """Undo a committed row whose bytes could not be put in place (best effort: the expiry removes it too)."""
        try:
            with Session(self.engine) as session, session.begin():
                session.execute(delete(FileRecord).where(FileRecord.id == file_id))
        except Exception:  # the database is what failed: the row stays, without bytes, until it expires
            pass

    def save(self, tenant: str, purpose: str, filename: str, source: IO[bytes], max_bytes: int,
             expires_s: int | None = None) -> FileInfo:
        """Store an upload read from ``source`` under a new id (the quota applies); nothing is kept on failure."""
        sink = self.receive(tenant, max_bytes)
        try:
            while chunk := source.read(CHUNK):
                sink.write(chunk)
        except BaseException:
            sink.discard()
            raise
        return self.commit(sink, tenant, purpose, filename, expires_s)

    def put(self, file_id: str, tenant: str, purpose: str, filename: str, chunks: Iterable[bytes],
            expires_s: int | None = None) -> FileInfo:
        """Write ``chunks`` as file ``file_id`` (replacing it whole if it exists): a job's output, never refused
        for the tenant's quota (the tenant's answers are not lost to it)."""
        sink = Sink(self.root, 2**63, None, "")
        try:
            for chunk in chunks:
                sink.write(chunk)
        except BaseException:
            sink.discard()
            raise
        return self.commit(sink, tenant, purpose, filename, expires_s, file_id=file_id)

    def delete(self, tenant: str, file_id: str) -> bool:
        """Remove the tenant's file (its bytes first, then its row); False when it has none of that id."""
        if self.get(tenant, file_id) is None:
            return False
        self.path(file_id).unlink(missing_ok=True)
        with Session(self.engine) as session, session.begin():
            done = session.execute(delete(FileRecord).where(FileRecord.id == file_id, FileRecord.tenant == tenant))
            return bool(done.rowcount)  # type: ignore[attr-defined]

    # -- clean-up --------------------------------------------------------------------------------------------
    def delete_expired(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` expired files (bytes, then row); returns how many. Several processes may run it
        at once: each file is removed once, and a crash between its two steps leaves its row for the next run."""
        f = FileRecord
        with Session(self.engine) as session:
            ids = list(session.scalars(select(f.id).where(and_(f.expires_at.is_not(None), f.expires_at <= self._now()))
                                       .order_by(f.expires_at).limit(limit)))
        for file_id in ids:
            if FILE_ID.match(file_id):
                self.path(file_id).unlink(missing_ok=True)
        if ids:
            with Session(self.engine) as session, session.begin():
                session.execute(delete(f).where(f.id.in_(ids)))
        return len(ids)

    def sweep(self, max_age_s: float = TEMP_MAX_AGE_S) -> int:
        """Remove temporary files older than ``max_age_s`` (left by a process killed mid-write); returns how many."""
        removed = 0
        cutoff = time.time() - max_age_s  # file times are this host's wall clock
        try:
            found = list(self.root.glob(TEMP_PREFIX + "*"))
        except OSError:
            return 0
        for tmp in found:
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    # -- reading ---------------------------------------------------------------------------------------
    def get(self, tenant: str | None, file_id: str) -> FileInfo | None:
        """The file, if it is ``tenant``'s (None: anyone's) and has not expired."""
        if not FILE_ID.match(file_id):
            return None
        with Session(self.engine) as session:
            r = session.get(FileRecord, file_id)
            if r is None or tenant not in (None, r.tenant):
                return None
            info = _info(r)
        return info if info.expires_at is None or info.expires_at > self._now() else None

    def open(self, file_id: str) -> IO[bytes]:
        return self.path(file_id).open("rb")

    def page(self, tenant: str, *, purpose: str | None = None, limit: int = 20, after: str | None = None,
             newest_first: bool = True) -> tuple[list[FileInfo], bool]:
        """A page of the tenant's files (not expired), and whether more follow."""
        f = FileRecord
        query = (select(f).where(f.tenant == tenant, self._live(self._now()))
                 .order_by(f.id.desc() if newest_first else f.id).limit(limit + 1))
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
