"""The front door of an API process in front of Flask: load shedding (:mod:`tasks.policy.shedding`) applied to
each inference request before Flask, the body, Redis or the database are touched, with a ready-made 429.

The rules are pure (:class:`tasks.policy.shedding.Door`); this is the WSGI shell around them, and the one place
the door's refusal body is made (:func:`refusal`, used by :mod:`webapp.accept_door` as well).
"""
from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import gevent

from tasks.config import Settings
from tasks.errors import QueueFull
from tasks.gateway.gate import Gate
from tasks.policy.shedding import Door
from tasks.state.metrics import HTTP_REQUESTS, REQUEST_LATENCY
from webapp.errors import NATIVE, OPENAI, status_of
from webapp.peek import PEEK_MAX_BYTES, tenant_of
from webapp.validation import bearer_token, request_id_from
from webapp.worker import arrival, placed_on_arrival

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment
    from _typeshed.wsgi import WSGIApplication as WSGIApp

    from tasks.store.directory import TenantDirectory

PEEK_TIMEOUT_S = 0.05
UNAUTHENTICATED = "(unauthenticated)"  # every caller without a known key, as one (not a tenant name)
NAME_MAX = 64  # a tenant name's longest: a longer X-Tenant is cut, not counted as a caller of its own


class DoorIdentity:
    """Who the door counts a call as (:class:`tasks.policy.callers.RecentCallers`): its tenant, never its header
    bytes. With keys, the tenant of the bearer token as memory knows it (:meth:`TenantDirectory.known_caller`:
    no query, no wait), the token read as authentication reads it (:func:`webapp.validation.bearer_token`), so
    spellings of one key are one caller; any key memory does not know is the one caller :data:`UNAUTHENTICATED`
    (authentication answers it 401), so a flood of random keys is one heavy caller. Without keys (``tenants``
    None), the tenant the call names: its X-Tenant header, trimmed and cut to a tenant name's length, or "" (its
    body may name it: the door reads that only when it needs to, :attr:`in_body`)."""

    def __init__(self, tenants: TenantDirectory | None = None) -> None:
        self.tenants = tenants

    def __call__(self, authorization: str | None, x_tenant: str | None) -> str:
        if self.tenants is None:
            return (x_tenant or "").strip()[:NAME_MAX]
        key = bearer_token(authorization or "")
        return (key and self.tenants.known_caller(key)) or UNAUTHENTICATED

    @property
    def in_body(self) -> bool:
        """Whether a call may name its tenant in its body (without keys)."""
        return self.tenants is None


def door_identity(settings: Settings, tenants: TenantDirectory) -> DoorIdentity:
    """The process's door identity: by key with ``LLMB_AUTH=keys``, else by the tenant a call names."""
    return DoorIdentity(None if settings.tenants.auth == "none" else tenants)


def process_share(settings: Settings) -> int:
    """Requests one API process may hold: its even share of both admission caps (gunicorn_conf adds a margin)."""
    return math.ceil((settings.admission.cap + settings.admission.offline_cap) / max(1, settings.web.workers))


def door_from_settings(settings: Settings, gate: Gate | None = None,
                       backlog: Callable[[], tuple[int, float]] = lambda: (0, 0.0)) -> Door:
    """The process's door: its share of the caps, its delay bound, its gate and the server's backlog
    (:meth:`webapp.worker.Arrivals.backlog`). It counts who sends what in the gate's count of callers, so
    that the gate, the admission rounds and the caps tell a light tenant by every arrival."""
    return Door(process_share(settings), settings.admission.retry_after_s, settings.admission.door_max_delay_s,
                gate=gate, backlog=backlog, callers=None if gate is None else gate.callers)


class DoorMiddleware:
    """The door in front of Flask: an inference request over the process's share, or one it got to too late,
    is refused with a ready-made 429 before Flask, the body, Redis or the database are touched, so that
    refusing a burst costs a small fraction of serving it. Requests let in are counted until their
    response is closed (a stream included). ``environ["llmb.arrived_at"]`` carries the arrival time on."""

    def __init__(self, app: WSGIApp, door: Door, is_inference: Callable[[str], bool],
                 identity: DoorIdentity | None = None) -> None:
        self.app = app
        self.door = door
        self.is_inference = is_inference
        self.identity = identity or DoorIdentity()

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        environ["llmb.arrived_at"], ready_at = arrival()
        in_line = placed_on_arrival()
        if environ.get("REQUEST_METHOD") != "POST" or not self.is_inference(environ.get("PATH_INFO", "")):
            return self.app(environ, start_response)
        try:
            caller = self.identity(environ.get("HTTP_AUTHORIZATION"), environ.get("HTTP_X_TENANT"))
            self.door.enter(ready_at, caller, (lambda: _tenant_in_body(environ)) if self.identity.in_body else None,
                            in_line=in_line)
        except QueueFull as exc:
            headers, body = refusal(exc, environ.get("PATH_INFO", ""), environ.get("HTTP_X_REQUEST_ID"),
                                    environ["llmb.arrived_at"])
            start_response(f"{status_of(exc.type)} Too Many Requests", headers)
            return [body]
        try:
            return _LeaveWhenDone(self.app(environ, start_response), self.door.leave)
        except BaseException:
            self.door.leave()
            raise


def refusal(error: QueueFull, path: str, request_id: str | None,
            arrived_at: float | None = None) -> tuple[list[tuple[str, str]], bytes]:
    """A door's ready-made 429: its headers and JSON body (the native or OpenAI shape, by path). It is counted,
    and its time from the request's arrival (``arrived_at``, monotonic; None: now) goes into the latency
    histogram beside the calls Flask answers: most refusals under a flood are the door's, and without them the
    histogram's 429 series told only of the few that reached Flask."""
    # no log line: it would cost more than the refusal
    status = str(status_of(error.type))
    HTTP_REQUESTS.labels(status, error.type).inc()
    REQUEST_LATENCY.labels(status).observe(0.0 if arrived_at is None else max(0.0, time.monotonic() - arrived_at))
    request_id = request_id_from(request_id)
    shape = NATIVE if path == "/v1/infer" else OPENAI
    body = json.dumps(shape.of(error, request_id)).encode()
    return [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            ("Retry-After", str(error.retry_after_s or 1)), ("X-Request-Id", request_id)], body


class _LeaveWhenDone:
    """A response iterable that calls ``leave`` once: when it is exhausted or closed, whichever is first (the
    server closes it; a test client may only exhaust it)."""

    def __init__(self, inner: Iterable[bytes], leave: Callable[[], None]) -> None:
        self.inner = inner
        self._leave: Callable[[], None] | None = leave

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.inner
        finally:
            self._done()

    def close(self) -> None:
        try:
            close = getattr(self.inner, "close", None)
            if close is not None:
                close()
        finally:
            self._done()

    def _done(self) -> None:
        leave, self._leave = self._leave, None
        if leave is not None:
            leave()


def _tenant_in_body(environ: WSGIEnvironment) -> str:
    """The tenant a small request body names (without API keys a caller may name itself there), read at the door
    only for a request it is about to refuse; the body is put back for Flask. "" when there is none, the body
    is large, or it does not come within PEEK_TIMEOUT_S (that request is refused as it would have been)."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or -1)
    except ValueError:
        return ""
    if not 0 < length <= PEEK_MAX_BYTES:
        return ""
    stream = environ["wsgi.input"]
    try:
        with gevent.Timeout(PEEK_TIMEOUT_S):
            body = stream.read(length)
    except (gevent.Timeout, OSError, ValueError):
        return ""
    environ["wsgi.input"] = io.BytesIO(body)
    return tenant_of(body)[:NAME_MAX]


