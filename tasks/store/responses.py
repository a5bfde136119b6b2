"""The Responses API's stored responses, in the SQL store: durable, per tenant, bounded, expiring.

A response with ``store`` (the default, as OpenAI's) is a row of the ``responses`` table: its Response object,
its request (less its input), its input items and the conversation's items before them, so that
``previous_response_id`` rebuilds the whole conversation (function calls and their outputs included) on any API
process, after any of them died. A background response is written before its call runs (``queued``) and
finished by whichever process sees its result first (:meth:`ResponseStore.finish`: only a response that is not
yet final changes, so two finishers agree and a cancelled one stays cancelled).

- **Tenancy.** Every lookup is scoped to a tenant: another tenant's response is not found.
- **Bound.** A tenant holds at most ``LLMB_RESPONSES_TENANT_MAX_COUNT`` stored responses (expired ones not
  counted); one more is refused (403 ``quota_exceeded``) before its call runs.
- **Expiry.** A response expires ``LLMB_RESPONSES_EXPIRE_S`` after its creation; from then it is not found, and
  it is deleted when its tenant next stores one (:meth:`ResponseStore.delete_expired` deletes any tenant's).
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from tasks.config import Settings
from tasks.errors import QuotaExceeded
from tasks.store.models import ResponseRecord, make_engine

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,59}$")
FINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass(frozen=True)
class Stored:
    """A stored response: its Response object, request, input items and the conversation before them."""

    id: str
    tenant: str
    status: str
    request_id: str
    body: dict[str, Any]
    request: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    created_at: float

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from: its history, its input, its output."""
        return [*self.history, *self.input_items, *self.body.get("output", [])]


def _stored(r: ResponseRecord) -> Stored:
    return Stored(r.id, r.tenant, r.status, r.request_id, json.loads(r.body), json.loads(r.request),
                  json.loads(r.input_items), json.loads(r.history), r.created_at)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class ResponseStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time, *, expire_s: int = 0,
                 tenant_max_count: int = 0) -> None:
        self.engine = engine
        self.clock = clock  # epoch seconds (expiry is compared across hosts)
        self.expire_s = expire_s  # 0: never
        self.tenant_max_count = tenant_max_count  # 0: no bound

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None,
                      clock: Callable[[], float] | None = None) -> ResponseStore:
        return cls(engine or make_engine(settings.stores.database_url), clock or time.time,
                   expire_s=settings.stores.responses_expire_s,
                   tenant_max_count=settings.stores.responses_tenant_max_count)

    def _live(self) -> ColumnElement[bool]:
        r = ResponseRecord
        return or_(r.expires_at.is_(None), r.expires_at > self.clock())

    def count(self, tenant: str) -> int:
        with Session(self.engine) as session:
            return int(session.execute(select(func.count()).where(ResponseRecord.tenant == tenant,
                                                                   self._live())).scalar_one())

    def check_room(self, tenant: str) -> None:
        """QuotaExceeded when the tenant holds as many stored responses as it may (checked before a call runs)."""
        if not self.tenant_max_count:
            return
        held = self.count(tenant)
        if held >= self.tenant_max_count:
            raise QuotaExceeded(f"tenant {tenant!r} holds {held} stored responses: its bound is "
                                f"{self.tenant_max_count} (LLMB_RESPONSES_TENANT_MAX_COUNT); delete responses it "
                                "no longer needs (DELETE /v1/responses/{id}), wait for them to expire, or send "
                                "'store': false")

    def save(self, tenant: str, request_id: str, body: dict[str, Any], request: dict[str, Any],
             input_items: list[dict[str, Any]], history: list[dict[str, Any]]) -> Stored:
        """Store a response (a new one, or its final state over an earlier one of the same id), and delete the
        tenant's expired ones."""
        created = float(body.get("created_at") or self.clock())
        record = ResponseRecord(id=body["id"], tenant=tenant, status=body["status"], request_id=request_id,
                                body=_dumps(body), request=_dumps(request), input_items=_dumps(input_items),
                                history=_dumps(history), created_at=created,
                                expires_at=created + self.expire_s if self.expire_s > 0 else None)
        with Session(self.engine) as session, session.begin():
            session.merge(record)
            r = ResponseRecord
            session.execute(delete(r).where(r.tenant == tenant, r.expires_at.is_not(None),
                                            r.expires_at <= self.clock()))
        return _stored(record)

    def finish(self, tenant: str, response_id: str, body: dict[str, Any]) -> Stored | None:
        """Write a response's final (or running) state unless it is final already; the response as it is now
        (None: not found)."""
        r = ResponseRecord
        with Session(self.engine) as session, session.begin():
            session.execute(update(r).where(r.id == response_id, r.tenant == tenant, r.status.not_in(FINAL))
                            .values(status=body["status"], body=_dumps(body)))
        return self.get(tenant, response_id)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's response of this id, if it has not expired."""
        if not RESPONSE_ID.match(response_id):
            return None
        with Session(self.engine) as session:
            found = session.scalars(select(ResponseRecord).where(ResponseRecord.id == response_id,
                                                                 ResponseRecord.tenant == tenant,
                                                                 self._live())).first()
            return None if found is None else _stored(found)

    def delete(self, tenant: str, response_id: str) -> bool:
        """Remove the tenant's response; False when it has none of that id."""
        if not RESPONSE_ID.match(response_id):
            return False
        with Session(self.engine) as session, session.begin():
            done = session.execute(delete(ResponseRecord).where(ResponseRecord.id == response_id,
                                                                ResponseRecord.tenant == tenant, self._live()))
            return bool(done.rowcount)  # type: ignore[attr-defined]

    def delete_expired(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` expired responses of any tenant; returns how many."""
        r = ResponseRecord
        with Session(self.engine) as session, session.begin():
            ids = list(session.scalars(select(r.id).where(and_(r.expires_at.is_not(None),
                                                                r.expires_at <= self.clock())).limit(limit)))
            if ids:
                session.execute(delete(r).where(r.id.in_(ids)))
        return len(ids)
