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
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import gevent

from tasks.broker.gate import Gate
from tasks.config import Settings
from tasks.errors import Overloaded, QueueFull
from tasks.policy.callers import RecentCallers
from tasks.state.metrics import HTTP_REQUESTS
from webapp.errors import NATIVE, OPENAI
from webapp.validation import request_id_from
from webapp.worker import arrival

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment
    from _typeshed.wsgi import WSGIApplication as WSGIApp


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
        delay = 0.0 if arrived_at is None else self.clock() - arrived_at
        wait = self.gate.expected_wait_s() if self.gate is not None else 0.0
        late = delay > self.max_delay_s
        behind = late or wait > self.max_delay_s - delay  # it could not get its turn in time
        if behind and not caller and identify is not None:
            caller = identify()
        self.callers.arrived(caller)
        if behind and not self.callers.light(caller):
            if late:
                raise Overloaded(f"this API process is running {delay * 1000:.0f} ms behind (a burst); retry in "
                                 f"{self.retry_after_s} s", retry_after_s=self.retry_after_s)
            assert self.gate is not None
            retry = self.gate.retry_after_s()
            raise Overloaded(f"this API process would take {(delay + wait) * 1000:.0f} ms to get to the request "
                             f"(more calls than it can admit in time); retry in {retry} s", retry_after_s=retry)
        with self._lock:
            if self.held >= self.limit:
                raise QueueFull(f"this API process holds {self.held} requests, its share of the admission caps; "
                                f"retry in {self.retry_after_s} s", retry_after_s=self.retry_after_s)
            self.held += 1

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
        arrived_at = environ["llmb.arrived_at"] = arrival()
        if environ.get("REQUEST_METHOD") != "POST" or not self.is_inference(environ.get("PATH_INFO", "")):
            return self.app(environ, start_response)
        try:
            self.door.enter(arrived_at, environ.get("HTTP_AUTHORIZATION") or environ.get("HTTP_X_TENANT") or "",
                            lambda: _tenant_in_body(environ))
        except QueueFull as exc:
            HTTP_REQUESTS.labels(str(exc.status), exc.type).inc()  # no log line: it would cost more than this
            request_id = request_id_from(environ.get("HTTP_X_REQUEST_ID"))
            shape = NATIVE if environ.get("PATH_INFO", "") == "/v1/infer" else OPENAI
            body = json.dumps(shape.body(exc.status, exc.type, exc.message, request_id)).encode()
            start_response(f"{exc.status} Too Many Requests", [
                ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                ("Retry-After", str(exc.retry_after_s or 1)), ("X-Request-Id", request_id)])
            return [body]
        try:
            return _LeaveWhenDone(self.app(environ, start_response), self.door.leave)
        except BaseException:
            self.door.leave()
            raise


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
    found = _TENANT.search(body)
    return found.group(1).decode("utf-8", "replace") if found else ""
