"""gunicorn's gevent worker, noting when each connection was accepted.

Under a burst the time between accepting a connection and running its handler (parsing, waiting for the CPU)
can be seconds. A deadline counted from the handler's start would then be answered after the caller's own
deadline; counted from the accept, it is not. The first request of a connection is timed from its accept;
later ones on a kept-alive connection from when their handler starts (their client sent them just then).
"""
from __future__ import annotations

import time
from typing import Any

from gevent.local import local
from gunicorn.workers.ggevent import GeventWorker

_connection = local()  # per greenlet (gevent's own: this module loads in gunicorn's master, before patching)


class ArrivalTimingWorker(GeventWorker):
    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        _connection.accepted_at = time.monotonic()
        super().handle(listener, client, addr)


def arrival() -> float:
    """When the request now being handled arrived (monotonic): its connection's accept for the first request
    of the connection, else now."""
    accepted: float | None = getattr(_connection, "accepted_at", None)
    _connection.accepted_at = None
    return accepted if accepted is not None else time.monotonic()
