"""Every table of the database, in one place (the schema is managed by Alembic in ``migrations/``).

Requests, batches and quarantined inputs are the outcome ledger (:mod:`tasks.store.ledger`); tenants and API
keys are :mod:`tasks.store.tenants`; LoRA adapters are :mod:`tasks.store.adapters`; files, batch jobs and their
lines are the Batch API's (:mod:`tasks.store.files`, :mod:`tasks.store.jobs`); stored responses are
:mod:`tasks.store.responses`. One engine factory serves them all, and the CLI's migrations.

Every string column of the ledger is a :class:`StorableString` / :class:`StorableText`: text a caller sent may
hold what a database refuses (NUL, lone surrogates), and one such record must not stop the rest.
"""
from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    create_engine,
    event,
)
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
    # what the call asked for besides its input (always kept: replay sends the same call again)
    params: Mapped[str | None] = mapped_column(StorableText)  # JSON: generation parameters, "chat": true, ...
    priority: Mapped[str | None] = mapped_column(StorableString(16))  # interactive or offline
    error: Mapped[str | None] = mapped_column(StorableText)
    batch_id: Mapped[str | None] = mapped_column(StorableString(64))  # the last batch that carried it
    accepted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    queued_ms: Mapped[float | None] = mapped_column(Float)
    run_ms: Mapped[float | None] = mapped_column(Float)
    # generation: the tokens the worker counted (the same figures as the call's OpenAI usage)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    trace_id: Mapped[str | None] = mapped_column(StorableString(32))  # its call's OpenTelemetry trace (tracing on)
    adapter: Mapped[str | None] = mapped_column(StorableString(128), index=True)  # the LoRA adapter it ran with


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


class AdapterRecord(Base):
    """A registered LoRA adapter: a call naming it runs on its base model with its PEFT directory
    (:mod:`tasks.store.adapters`). No tenant: every tenant may use it."""

    __tablename__ = "adapters"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(Text)  # the PEFT directory, as the workers see it
    rank: Mapped[int] = mapped_column(Integer)  # "r" of its adapter_config.json
    tenant: Mapped[str | None] = mapped_column(String(64), index=True)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)  # once loaded, a worker never evicts it
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class FileRecord(Base):
    """A file of the Batch API (an uploaded input, or a job's output or errors); its bytes are in the file store."""

    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # time-ordered: listing sorts by id
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    purpose: Mapped[str] = mapped_column(String(32))  # batch (uploaded), batch_output (written by a job)
    filename: Mapped[str] = mapped_column(StorableString(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)  # None: never


class BatchJobRecord(Base):
    """One batch job: its status, counters and output files, and the lease of the `llmb-jobs` process running it."""

    __tablename__ = "batch_jobs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # time-ordered: listing sorts by id
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    # validating, in_progress, finalizing, completed, failed, cancelling, cancelled, expired
    status: Mapped[str] = mapped_column(String(16), index=True)
    meta: Mapped[str | None] = mapped_column(StorableText)  # the caller's metadata, JSON
    errors: Mapped[str | None] = mapped_column(StorableText)  # validation errors, JSON (OpenAI's "errors")
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)  # epoch seconds, as OpenAI reports them
    expires_at: Mapped[float] = mapped_column(Float)
    in_progress_at: Mapped[float | None] = mapped_column(Float)
    finalizing_at: Mapped[float | None] = mapped_column(Float)
    completed_at: Mapped[float | None] = mapped_column(Float)
    failed_at: Mapped[float | None] = mapped_column(Float)
    expired_at: Mapped[float | None] = mapped_column(Float)
    cancelling_at: Mapped[float | None] = mapped_column(Float)
    cancelled_at: Mapped[float | None] = mapped_column(Float)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[float | None] = mapped_column(Float)  # epoch seconds on the fleet's shared clock
    output_expires_s: Mapped[int | None] = mapped_column(Integer)  # its output files' expiry (None: the default)


class BatchLineRecord(Base):
    """One line (request) of a batch job. It is finished once its output row is committed (status ok or error);
    ``request_id`` is its correlation id in the ledger's ``requests`` table, which links it to its batches."""

    __tablename__ = "batch_lines"
    __table_args__ = (Index("ix_batch_lines_job_status", "job_id", "status"),)
    job_id: Mapped[str] = mapped_column(String(64), ForeignKey("batch_jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    line_no: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based, in input order
    custom_id: Mapped[str] = mapped_column(StorableText)
    request_id: Mapped[str] = mapped_column(String(128), index=True)
    body: Mapped[str] = mapped_column(Text)  # the request body, JSON (ASCII: every escape kept)
    status: Mapped[str] = mapped_column(String(16))  # pending, ok, error
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # submissions that did not finish it
    status_code: Mapped[int | None] = mapped_column(Integer)
    output: Mapped[str | None] = mapped_column(Text)  # the whole output (or error) file line, JSON
    finished_at: Mapped[float | None] = mapped_column(Float)


class ResponseRecord(Base):
    """A stored response of the Responses API (``/v1/responses``): its Response object, its input items and the
    conversation before them (what ``previous_response_id`` continues), and the gateway call that runs it."""

    __tablename__ = "responses"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_ + time-ordered hex
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16))  # queued, in_progress, completed, incomplete, failed, cancelled
    request_id: Mapped[str] = mapped_column(String(128))  # the gateway call (GET /v1/requests/<id>)
    body: Mapped[str] = mapped_column(StorableText)  # the Response object, JSON
    request: Mapped[str] = mapped_column(StorableText)  # the request body (less its input), JSON
    input_items: Mapped[str] = mapped_column(StorableText)  # this turn's input items, JSON
    history: Mapped[str] = mapped_column(StorableText)  # the conversation's items before them, JSON
    created_at: Mapped[float] = mapped_column(Float)  # epoch seconds
    expires_at: Mapped[float | None] = mapped_column(Float, index=True)  # None: never


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
