"""The front door's own limit: inference requests one API process holds at once, counted in memory.

The admission caps (``LLMB_ADMISSION_CAP`` + ``LLMB_OFFLINE_ADMISSION_CAP``) are kept in Redis across every API
process; each process of a host serves its share of them (gunicorn_conf sizes its connections for that share
plus a margin). A process already holding its share of requests cannot admit more anyway, so it refuses the
next at once (429 queue_full with Retry-After) from this counter: before the body is read, before Redis or the
database is asked, so that a refusal costs far less than an admission and a flood cannot crowd out the
callers already admitted.
"""
from __future__ import annotations

import io
import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gevent

from tasks.broker.gate import Gate
from tasks.config import Settings
from tasks.errors import Overloaded, QueueFull
from tasks.policy.callers import RecentCallers
from tasks.schema import Priority
from tasks.state.metrics import HTTP_REQUESTS
from webapp.errors import NATIVE, OPENAI
from webapp.validation import asks_offline, bearer_token, named_tenant, priority_class, request_id_from
from webapp.worker import arrival, backlog

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment
    from _typeshed.wsgi import WSGIApplication as WSGIApp

    from tasks.broker.gateway import Gateway
    from tasks.store.tenants import TenantDirectory


def process_share(settings: Settings) -> int:
    """Requests one API process may hold: its even share of both admission caps (gunicorn_conf adds a margin)."""
    return math.ceil((settings.admission_cap + settings.offline_admission_cap) / max(1, settings.web_workers))


class Door:
    """Counts the requests this process holds; :meth:`enter` refuses beyond ``limit``, and refuses any request
    the process got to more than ``max_delay_s`` after it arrived.

    The delay is the process's own queue: under a burst, thousands of connections wait for the CPU between
    their accept and their handler. Admitting them anyway would let every admitted caller be answered late
    (the answers queue behind the same CPU); refusing the late ones at this point costs a fraction of an
    admission and lets the queue drain (like CoDel, with the delay measured per request, not sampled)."""

    def __init__(self, limit: int, retry_after_s: int, max_delay_s: float = float("inf"),
                 clock: Callable[[], float] = time.monotonic, gate: Gate | None = None) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.max_delay_s = max_delay_s
        self.clock = clock
        self.gate = gate  # the process's turnstile in front of admission: a request that would wait too long is refused
        self.held = 0
        self.last_delay_s = 0.0  # how long the last request entering waited for this process to get to it
        self.callers = RecentCallers(clock)
        self._lock = threading.Lock()  # gevent's own lock once gunicorn's worker has monkey-patched threading

    @classmethod
    def from_settings(cls, settings: Settings, gate: Gate | None = None) -> Door:
        return cls(process_share(settings), settings.retry_after_s, settings.door_max_delay_ms / 1000, gate=gate)

    def enter(self, arrived_at: float | None = None, caller: str = "",
              identify: Callable[[], str] | None = None) -> None:
        """Count one more request held, or raise QueueFull (nothing counted) when the process holds its share,
        or Overloaded when the request waited longer than ``max_delay_s`` for this process to get to it, or
        would wait too long for its turn at admission.

        ``caller`` says who sends it (its API key or X-Tenant header); when it is empty and the request is about
        to be refused, ``identify`` may name it (the tenant in its body). A caller sending well under an even
        share of this process's recent requests is let in late all the same: a burst from one caller must not
        get the others refused."""
        delay = self.last_delay_s = 0.0 if arrived_at is None else self.clock() - arrived_at
        error = self._behind(delay, caller, identify)
        if error is not None:
            raise error
        with self._lock:
            if self.held >= self.limit:
                raise QueueFull(f"this API process holds {self.held} requests, its share of the admission caps; "
                                f"retry in {self.retry_after_s} s", retry_after_s=self.retry_after_s)
            self.held += 1

    def behind_at_accept(self, delay: float | None = None) -> bool:
        """Whether a request accepted now would be refused for want of time: by its ``delay`` so far, or (None) by
        the delay expected of a request arriving now (see :meth:`_expected_delay`)."""
        return self._late_or_turnless(self._expected_delay() if delay is None else delay)[0]

    def refusal_at_accept(self, caller: str, delay: float | None = None) -> Overloaded | None:
        """The refusal of a request just accepted (see :meth:`behind_at_accept`) unless its caller is light (None:
        let it in). A caller let in here is counted again when its request reaches :meth:`enter`: while the
        process is behind, a light caller looks up to twice as busy as it is (still light unless near the line)."""
        delay = self._expected_delay() if delay is None else delay
        if not self._late_or_turnless(delay)[0] or self.callers.light(caller):
            return None
        return self._behind(delay, caller, None)

    def _expected_delay(self) -> float:
        """How long a request accepted now will wait for this process to get to it: while connections are still
        waiting for it (:func:`webapp.worker.backlog`), as long as the last request it got to waited, or the
        oldest of them so far if longer; nothing once none wait (the requests let in then measure it again)."""
        waiting, oldest_s = backlog()
        return max(oldest_s, self.last_delay_s) if waiting else 0.0

    def _late_or_turnless(self, delay: float) -> tuple[bool, bool, float]:
        """(behind, late, expected wait at the gate) for a request ``delay`` behind: late when it waited more
        than ``max_delay_s``, behind when also it could not get its turn in time."""
        wait = self.gate.expected_wait_s() if self.gate is not None else 0.0
        late = delay > self.max_delay_s
        return late or wait > self.max_delay_s - delay, late, wait

    def _behind(self, delay: float, caller: str, identify: Callable[[], str] | None) -> Overloaded | None:
        """Overloaded when a request ``delay`` behind could not get its turn in time, unless its caller is light
        (the caller is counted either way)."""
        behind, late, wait = self._late_or_turnless(delay)
        if behind and not caller and identify is not None:
            caller = identify()
        self.callers.arrived(caller)
        if not behind or self.callers.light(caller):
            return None
        if late:
            return Overloaded(f"this API process is running {delay * 1000:.0f} ms behind (a burst); retry in "
                              f"{self.retry_after_s} s", retry_after_s=self.retry_after_s)
        assert self.gate is not None
        retry = self.gate.retry_after_s()
        return Overloaded(f"this API process would take {(delay + wait) * 1000:.0f} ms to get to the request "
                          f"(more calls than it can admit in time); retry in {retry} s", retry_after_s=retry)

    def leave(self) -> None:
        with self._lock:
            self.held -= 1


class DoorMiddleware:
    """The door in front of Flask: an inference request over the process's share, or one it got to too late,
    is refused with a ready-made 429 before Flask, the body, Redis or the database are touched, so that
    refusing a burst costs a small fraction of serving it. Requests let in are counted until their
    response is closed (a stream included). ``environ["llmb.arrived_at"]`` carries the arrival time on."""

    def __init__(self, app: WSGIApp, door: Door, is_inference: Callable[[str], bool]) -> None:
        self.app = app
        self.door = door
        self.is_inference = is_inference

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        environ["llmb.arrived_at"], ready_at = arrival()
        if environ.get("REQUEST_METHOD") != "POST" or not self.is_inference(environ.get("PATH_INFO", "")):
            return self.app(environ, start_response)
        try:
            self.door.enter(ready_at, environ.get("HTTP_AUTHORIZATION") or environ.get("HTTP_X_TENANT") or "",
                            lambda: _tenant_in_body(environ))
        except QueueFull as exc:
            headers, body = _refusal(exc, environ.get("PATH_INFO", ""), environ.get("HTTP_X_REQUEST_ID"))
            start_response(f"{exc.status} Too Many Requests", headers)
            return [body]
        try:
            return _LeaveWhenDone(self.app(environ, start_response), self.door.leave)
        except BaseException:
            self.door.leave()
            raise


def _refusal(error: QueueFull, path: str, request_id: str | None) -> tuple[list[tuple[str, str]], bytes]:
    """A door's ready-made 429: its headers and JSON body (the native or OpenAI shape, by path)."""
    HTTP_REQUESTS.labels(str(error.status), error.type).inc()  # no log line: it would cost more than the refusal
    request_id = request_id_from(request_id)
    shape = NATIVE if path == "/v1/infer" else OPENAI
    body = json.dumps(shape.body(error.status, error.type, error.message, request_id)).encode()
    return [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            ("Retry-After", str(error.retry_after_s or 1)), ("X-Request-Id", request_id)], body


class AcceptDoor:
    """The door at accept: while the process is behind, a request is refused from its bytes already arrived,
    before gunicorn parses it or a greenlet is spawned for it.

    Under a flood the refusals are most of the work: at three times the capacity of one 250 ms device, two
    API processes refuse 800 requests a second, and gunicorn's parsing, the WSGI environ and the response cost
    about half a millisecond each, enough with the admitted calls to keep the processes behind, and then everything is
    refused, the admitted calls' own round trips waiting behind the refusals. Here a refusal is a peek at the
    socket, a few header lookups, one write and a close. Anything this does not handle plainly (a request not
    all arrived yet, no Content-Length, chunked, not an inference call) goes the usual way, to be refused or let
    in by :class:`DoorMiddleware` with the same rules."""

    def __init__(self, door: Door, is_inference: Callable[[str], bool], held: HeldFull | None = None) -> None:
        self.door = door
        self.is_inference = is_inference
        self.held = held

    def __call__(self, sock: socket.socket, delay: float | None = None) -> bool:
        """Refuse the request on this connection if the door would (by its ``delay`` so far, or by the delay
        expected now), or the gateway would for want of room (True: answered; the caller closes the connection)."""
        behind = self.door.behind_at_accept(delay)
        if not behind and (self.held is None or not self.held.any()):
            return False
        request = _peek_request(sock)
        if request is None or not self.is_inference(request.path):
            return False
        caller = request.headers.get("authorization") or request.headers.get("x-tenant") or _tenant_of(request.body)
        # a light caller is not held to a flood's FULL verdict (the gateway lets it past: it is served fairly)
        light = self.door.callers.light(caller)
        error: QueueFull | None = None if self.held is None or light else self.held.refusal(request)
        if error is not None:
            self.door.callers.arrived(caller)  # counted as if it had entered, as the gateway's refusal would be
        elif behind:
            error = self.door.refusal_at_accept(caller, delay)
        if error is None:
            return False
        headers, body = _refusal(error, request.path, request.headers.get("x-request-id"))
        head = "".join(f"{k}: {v}\r\n" for k, v in [*headers, ("Connection", "close")])
        try:
            sock.settimeout(0.0)
            sock.recv(request.size)  # all there: the peek saw it
            sock.sendall(f"HTTP/1.1 {error.status} Too Many Requests\r\n{head}\r\n".encode("latin-1") + body)
        except OSError:
            pass  # the caller is gone, or the response did not fit at once: it is closed all the same
        return True


class HeldFull:
    """The gateway's fresh FULL verdicts (:meth:`tasks.broker.gateway.Gateway.held_full`), applied at accept.

    Under a flood most calls are refused for want of room, and for a few milliseconds after each such verdict the
    gateway refuses every call of that model and class with it, after gunicorn, Flask, authentication and the
    body's parsing have run (about half a millisecond each). Here the same refusal goes out from the request's
    bytes when the door can tell its model and class without I/O: the model from the body (or the default), the
    class from the body and the caller's tenant as the caches know it. A caller they do not know yet (a key not
    looked up, a tenant not seen), a body that is not a small JSON object, or a retry with an Idempotency-Key
    (it may be answered from its first call) goes the usual way."""

    def __init__(self, gateway: Gateway, tenants: TenantDirectory, settings: Settings) -> None:
        self.gateway = gateway
        self.tenants = tenants
        self.default_model = settings.default_model
        self.keys = settings.auth != "none"

    def any(self) -> bool:
        return self.gateway.holds_full()

    def refusal(self, request: _Peeked) -> QueueFull | None:
        if "idempotency-key" in request.headers:
            return None
        try:
            body = json.loads(request.body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: its 400 comes later
            return None
        if not isinstance(body, dict):
            return None
        native = request.path == "/v1/infer"
        model = body.get("model", self.default_model if native else None)
        if not isinstance(model, str):
            return None
        if self.keys:
            key = bearer_token(request.headers.get("authorization", ""))
            known = None if key is None else self.tenants.cached_priority(key, "")
        else:
            header = request.headers.get("x-tenant")
            tenant = named_tenant(body, header) if native else header or "default"
            known = self.tenants.cached_priority(None, tenant) if isinstance(tenant, str) else None
        if known is None:
            return None
        asked = Priority.OFFLINE if asks_offline(body, openai=not native) else Priority.INTERACTIVE
        return self.gateway.held_full(model, priority_class(asked, known))


@dataclass(frozen=True)
class _Peeked:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    size: int  # bytes of the whole request


def _peek_request(sock: socket.socket) -> _Peeked | None:
    """The request already arrived on a new connection, read without taking it off the socket (None: not all
    there, or not a plain POST with a Content-Length)."""
    timeout = sock.gettimeout()
    try:
        sock.settimeout(0.0)
        data = sock.recv(PEEK_MAX_BYTES + 8192, socket.MSG_PEEK)
    except OSError:
        return None
    finally:
        sock.settimeout(timeout)
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    request_line, *lines = data[:end].decode("latin-1").split("\r\n")
    method, _, rest = request_line.partition(" ")
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip()
    try:
        length = int(headers.get("content-length", ""))
    except ValueError:
        return None
    size = end + 4 + length
    if method != "POST" or "transfer-encoding" in headers or length < 0 or len(data) < size:
        return None
    return _Peeked(rest.split(" ", 1)[0].split("?", 1)[0], headers, data[end + 4:size], size)


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


PEEK_MAX_BYTES = 16_384  # a body the door may read to find its tenant: a small one, all there already
PEEK_TIMEOUT_S = 0.05
_TENANT = re.compile(rb'"tenant"\s*:\s*"([^"\\]{1,64})"')


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
    return _tenant_of(body)


def _tenant_of(body: bytes) -> str:
    found = _TENANT.search(body) if len(body) <= PEEK_MAX_BYTES else None
    return found.group(1).decode("utf-8", "replace") if found else ""
