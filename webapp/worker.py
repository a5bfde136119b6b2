"""gunicorn's gevent worker, noting when each connection was accepted, and accepting eagerly.

Under a burst the time between accepting a connection and running its handler (parsing, waiting for the CPU)
can be seconds. A deadline counted from the handler's start would then be answered after the caller's own
deadline; counted from the accept, it is not, and the door (:mod:`webapp.door`) refuses a request its process
got to too late. The first request of a connection is timed from its accept; later ones on a kept-alive
connection from when their handler starts (their client sent them just then).

Two changes to gunicorn's gevent server make that wait visible:

* the accept time is taken when the connection is accepted, not when its greenlet first runs (behind every
  other ready greenlet: the wait the door must see);
* with several workers gunicorn accepts one connection per wake-up of the listening socket. A process short of
  CPU then leaves the rest in the kernel's accept queue, where nothing can see or refuse them; this worker
  accepts up to :data:`ACCEPT_BATCH` at once, so they wait where their delay is measured.

And one to its responses: gunicorn writes a response's headers and its body with a system call each; this
worker holds the headers back and sends them with the first piece of the body (the two writes were 7.7% of
an API process's CPU under load, measured with py-spy).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import gunicorn.http.wsgi as wsgi
import gunicorn.workers.ggevent as ggevent
from gevent.baseserver import _handle_and_close_when_done  # type: ignore[attr-defined]
from gevent.local import local
from gevent.server import StreamServer
from gunicorn.workers.ggevent import GeventWorker

_connection = local()  # per greenlet (gevent's own: this module loads in gunicorn's master, before patching)
ACCEPT_BATCH = 64  # connections accepted per wake-up of the listening socket


# What may refuse a request on a just-accepted connection before a greenlet is spawned for it (the app's
# webapp.door.AcceptDoor, set by create_app): True when it answered; the connection is then closed.
at_accept: Callable[[Any], bool] | None = None
_unstarted: OrderedDict[object, float] = OrderedDict()  # accepted connections whose greenlet has not run yet


def backlog() -> tuple[int, float]:
    """Accepted connections whose greenlet has not run yet, and how long the oldest of them has waited."""
    oldest = next(iter(_unstarted.values()), None)
    return len(_unstarted), 0.0 if oldest is None else time.monotonic() - oldest


def _refused_at_accept(sock: Any) -> bool:
    """Whether :data:`at_accept` answered the request on ``sock``; a defect of its own sends the request the usual
    way (logged), never takes the connection down."""
    assert at_accept is not None
    try:
        return at_accept(sock)
    except Exception:
        logging.getLogger("llmb.web").exception("the door at accept failed on a request; it goes the usual way")
        return False


class _TimedServer(StreamServer):
    """gevent's StreamServer, accepting in batches and stamping each connection with its accept time."""

    max_accept = property(lambda self: ACCEPT_BATCH, lambda self, value: None)  # gunicorn's 1 is ignored

    def do_handle(self, *args: Any) -> None:
        accepted_at, handle = time.monotonic(), self._handle
        if at_accept is not None and _refused_at_accept(args[0]):
            self.do_close(*args)
            return

        token = object()

        def timed(*a: Any) -> Any:
            _unstarted.pop(token, None)
            _connection.accepted_at = accepted_at
            return handle(*a)

        _unstarted[token] = accepted_at
        try:
            self._spawn(_handle_and_close_when_done, timed, self.do_close, args)
        except BaseException:
            _unstarted.pop(token, None)
            self.do_close(*args)
            raise


class _HeldHeaders:
    """A response's socket that holds the headers back (:meth:`hold`) to send them with the next write."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self._holding = False
        self._held = b""

    def hold(self) -> None:
        self._holding = True

    def sendall(self, data: bytes) -> None:
        if self._holding:
            self._holding, self._held = False, bytes(data)
            return
        self.flush(data)

    def flush(self, data: bytes = b"") -> None:
        held, self._held = self._held, b""
        if held or data:
            self.sock.sendall(held + data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class _OneWriteResponse(wsgi.Response):
    """gunicorn's response, its headers sent with the first piece of its body in one write."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sock = _HeldHeaders(self.sock)  # type: ignore[has-type]

    def send_headers(self) -> None:
        if not self.headers_sent:
            self.sock.hold()
        super().send_headers()

    def sendfile(self, respiter: Any) -> Any:
        self.send_headers()
        self.sock.flush()  # the file goes straight from the kernel: the headers must be out first
        return super().sendfile(respiter)

    def close(self) -> None:
        super().close()
        self.sock.flush()  # a response without a body (or a chunked one's last chunk)


class ArrivalTimingWorker(GeventWorker):
    def run(self) -> None:
        # gunicorn's run() builds its servers, and each request its response, from these names (this process only)
        ggevent.StreamServer = _TimedServer
        wsgi.Response = _OneWriteResponse
        super().run()


def arrival() -> float:
    """When the request now being handled arrived (monotonic): its connection's accept for the first request
    of the connection, else now."""
    accepted: float | None = getattr(_connection, "accepted_at", None)
    _connection.accepted_at = None
    return accepted if accepted is not None else time.monotonic()
