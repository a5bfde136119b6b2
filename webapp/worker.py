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
"""
from __future__ import annotations

import time
from typing import Any

import gunicorn.workers.ggevent as ggevent
from gevent.baseserver import _handle_and_close_when_done  # type: ignore[attr-defined]
from gevent.local import local
from gevent.server import StreamServer
from gunicorn.workers.ggevent import GeventWorker

_connection = local()  # per greenlet (gevent's own: this module loads in gunicorn's master, before patching)
ACCEPT_BATCH = 64  # connections accepted per wake-up of the listening socket


class _TimedServer(StreamServer):
    """gevent's StreamServer, accepting in batches and stamping each connection with its accept time."""

    max_accept = property(lambda self: ACCEPT_BATCH, lambda self, value: None)  # gunicorn's 1 is ignored

    def do_handle(self, *args: Any) -> None:
        accepted_at, handle = time.monotonic(), self._handle

        def timed(*a: Any) -> Any:
            _connection.accepted_at = accepted_at
            return handle(*a)

        try:
            self._spawn(_handle_and_close_when_done, timed, self.do_close, args)
        except BaseException:
            self.do_close(*args)
            raise


class ArrivalTimingWorker(GeventWorker):
    def run(self) -> None:
        ggevent.StreamServer = _TimedServer  # gunicorn's run() builds its servers from this name (this process only)
        super().run()


def arrival() -> float:
    """When the request now being handled arrived (monotonic): its connection's accept for the first request
    of the connection, else now."""
    accepted: float | None = getattr(_connection, "accepted_at", None)
    _connection.accepted_at = None
    return accepted if accepted is not None else time.monotonic()
