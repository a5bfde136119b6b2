"""Every table of the database, in one place (the schema is managed by Alembic in ``migrations/``).

Requests, batches and quarantined inputs are the outcome ledger (:mod:`tasks.store.ledger`); tenants and API
keys are :mod:`tasks.store.tenants`. One engine factory serves both, and the CLI's migrations.

Every string column of the ledger is a :class:`StorableString` / :class:`StorableText`: text a caller sent may
hold what a database refuses (NUL, lone surrogates), and one such record must not stop the rest.
"""
from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Boolean, DateTime, Dialect, Float, ForeignKey, Integer, String, Text, create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> str:
    """``text`` as every supported database stores it: NUL (PostgreSQL refuses it in text columns) and lone
    surrogates (which have no UTF-8 encoding, so no driver can send them) become U+FFFD."""
    return _UNSTORABLE.sub("\ufffd", text)


class StorableString(TypeDecorator[str]):
    """``String(n)`` whose values are passed through :func:`storable`: the one place text is made storable."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return storable(value) if isinstance(value, str) else value


class StorableText(StorableString):
    """``Text``, made storable the same way."""

    impl = Text
    cache_ok = True


class Base(DeclarativeBase):
    pass


class RequestRecord(Base):
    """One input (batch item) and its final outcome."""

    __tablename__ = "requests"
    id: Mapped[str] = mapped_column(StorableString(64), primary_key=True)  # item id
    correlation_id: Mapped[str] = mapped_column(StorableString(128), index=True)
    tenant: Mapped[str] = mapped_column(StorableString(64), index=True)
    model: Mapped[str] = mapped_column(StorableString(128), index=True)
    # ok, retrying, poison, expired, exhausted, rejected
    status: Mapped[str] = mapped_column(StorableString(16), index=True)
    input_hash: Mapped[str] = mapped_column(StorableString(32), index=True)
    input: Mapped[str | None] = mapped_column(StorableText)  # only with LLMB_STORE_INPUTS
    error: Mapped[str | None] = mapped_column(StorableText)
    batch_id: Mapped[str | None] = mapped_column(StorableString(64))  # the last batch that carried it
    accepted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    queued_ms: Mapped[float | None] = mapped_column(Float)
    run_ms: Mapped[float | None] = mapped_column(Float)


class BatchRecord(Base):
    """One batch as run (or failed) on one worker; splits point to their parent."""

    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(StorableString(64), primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(StorableString(64), index=True)
    model: Mapped[str] = mapped_column(StorableString(128))
    worker: Mapped[str | None] = mapped_column(StorableString(255), index=True)
    size: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(StorableString(16), index=True)  # ok, raised, died, reassigned
    error: Mapped[str | None] = mapped_column(StorableText)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    run_ms: Mapped[float | None] = mapped_column(Float)


class BatchRequest(Base):
    """Which requests a batch carried."""

    __tablename__ = "batch_requests"
    batch_id: Mapped[str] = mapped_column(StorableString(64), ForeignKey("batches.id", ondelete="CASCADE"),
                                          primary_key=True)
    request_id: Mapped[str] = mapped_column(StorableString(64), primary_key=True, index=True)


class QuarantineRecord(Base):
    """An input that failed alone; refused at the door until released."""

    __tablename__ = "quarantined_inputs"
    input_hash: Mapped[str] = mapped_column(StorableString(32), primary_key=True)
    model: Mapped[str] = mapped_column(StorableString(128))
    reason: Mapped[str] = mapped_column(StorableText)
    batch_id: Mapped[str] = mapped_column(StorableString(64))
    request_id: Mapped[str] = mapped_column(StorableString(64))
    input: Mapped[str | None] = mapped_column(StorableText)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    released_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TenantRecord(Base):
    """A tenant's own settings; an empty column means "the default"."""

    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    weight: Mapped[float] = mapped_column(Float)
    max_in_flight: Mapped[int | None] = mapped_column(Integer)
    priority: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ApiKeyRecord(Base):
    """One issued key, by the SHA-256 of its text."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    label: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


def make_engine(url: str) -> Engine:
    """An engine that several processes can share a SQLite file through (WAL, waiting on locks)."""
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)
