"""gunicorn's gevent worker, noting when each request arrived, and accepting eagerly.

Under a burst the time between a request's arrival and its handler (parsing, waiting for the CPU) can be
seconds. A deadline counted from the handler's start would then be answered after the caller's own deadline;
counted from the arrival, it is not, and the door (:mod:`webapp.door`) refuses a request its process got to
too late. A request arrives when its first byte reaches the host: the kernel stamps it (``SO_TIMESTAMPNS``,
:func:`webapp.connections.stamp_arrivals`), so neither the process's own delay in looking nor a client's delay
between connecting and writing (seconds, for a busy client opening thousands of connections) is mistimed; or
at its connection's accept, if that came later (:func:`arrived_at`).

Two changes to gunicorn's gevent server make that wait visible:

* the accept time is taken when the connection is accepted, not when its greenlet first runs (behind every
  other ready greenlet: the wait the door must see);
* with several workers gunicorn accepts one connection per wake-up of the listening socket. A process short of
  CPU then leaves the rest in the kernel's accept queue, where nothing can see or refuse them; this worker
  accepts up to :data:`ACCEPT_BATCH` at once, so they wait where their delay is measured.

How connections are kept, timed and closed (idle keep-alive, the header timeout from a request's first byte,
lingering closes, gunicorn's own errors in JSON) is :mod:`webapp.connections`, and the pace at which requests
are taken in while the process is behind is :mod:`webapp.intake`; this worker plugs both in.

And one to its responses: gunicorn writes a response's headers and its body with a system call each; this
worker holds the headers back and sends them with the first piece of the body (the two writes were 7.7% of
an API process's CPU under load, measured with py-spy). Each write waits at most ``LLMB_STREAM_SEND_TIMEOUT_MS``
for the client to take bytes (gevent's sockets have no send timeout): a client that stopped reading ends its
connection then, and the response's iterator is closed, releasing what it holds (a stream's generation, a
resumed stream's slot), rather than holding them until TCP gives up.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Protocol

import gevent
import gunicorn.http as http
import gunicorn.http.wsgi as wsgi
import gunicorn.util as gunicorn_util
import gunicorn.workers.ggevent as ggevent
from gevent.baseserver import _handle_and_close_when_done
from gevent.local import local
from gevent.server import StreamServer
from gunicorn.workers.ggevent import GeventWorker

from tasks.config import Settings
from webapp import connections
from webapp.connections import AtDoor
from webapp.intake import Intake

_connection = local()  # per greenlet (gevent's own: this module loads in gunicorn's master, before patching)
ACCEPT_BATCH = 64  # connections accepted per wake-up of the listening socket
START_BATCH = 48  # connections whose greenlets start per pass of the event loop over what it has ready
# answers to a request whose body was not read (too slow, too large): the connection ends (lingering), rather
# than reading and dropping a body that may never end
CLOSING_STATUSES = frozenset({408, 413, 507})


class DoorAtAccept(Protocol):
    """What judges a request from its bytes (:class:`webapp.accept_door.AcceptDoor`)."""

    def __call__(self, sock: Any, delay: float | None = None, *, arriving: bool = False,
                 arrived_at: float | None = None, in_line: bool = False, at_accept: bool = False) -> AtDoor: ...

    def caller(self, sock: Any) -> str: ...


ARRIVALS = "llmb.arrivals"  # the key of the app's Arrivals in app.extensions, where its worker finds them


class Arrivals:
    """One API process's requests before it gets to them, shared by its app and its worker: the app's door judges
    by the backlog (:meth:`backlog`), and the app sets what may refuse a request from its bytes (``at_accept``);
    the worker keeps the backlog (``unstarted``, ``intake``) and asks ``at_accept`` (:meth:`judged`).

    ``at_accept`` (the app's :class:`webapp.accept_door.AcceptDoor`) judges a request on a just-accepted
    connection before a greenlet is spawned for it, as its bytes arrive (by the process's backlog and its model's
    admission queue: ``arriving``, with its arrival time), and at intake with the time the request waited for its
    turn (``in_line``: let in by its queue on arrival)."""

    def __init__(self) -> None:
        self.at_accept: DoorAtAccept | None = None
        self.unstarted: OrderedDict[object, float] = OrderedDict()  # accepted connections whose greenlet has not run
        self.intake: Intake | None = None  # the worker process's pace of intake (made in the worker, after the fork)

    def backlog(self) -> tuple[int, float]:
        """Requests this process has not got to yet: accepted connections whose greenlet has not run, and requests
        waiting for their turn at intake (:mod:`webapp.intake`); and the least a request arriving now would wait
        (the oldest of them so far, or the intake's line at its measured rate)."""
        oldest = next(iter(self.unstarted.values()), None)
        unstarted_s = 0.0 if oldest is None else time.monotonic() - oldest
        if self.intake is None:
            return len(self.unstarted), unstarted_s
        return len(self.unstarted) + self.intake.waiting, max(unstarted_s, self.intake.expected_wait_s())

    def judged(self, sock: Any, waited_s: float | None = None, arriving: bool = False,
               accepted_at: float | None = None) -> AtDoor:
        """What ``at_accept`` did with the request on ``sock`` (true when it answered it): just accepted (no
        greenlet yet, at ``accepted_at``), ``arriving`` (its bytes have just come, on the connection's greenlet),
        or at its turn (``waited_s``). A defect of its own sends the request the usual way (logged), never takes
        the connection down."""
        at_accept = self.at_accept
        assert at_accept is not None
        try:
            if accepted_at is not None:
                return at_accept(sock, arriving=True, arrived_at=accepted_at, at_accept=True)
            arrived = arrived_at(getattr(_connection, "accepted_at", None), getattr(_connection, "seen_at", None))
            placed = getattr(_connection, "placed", AtDoor.UNSEEN)
            if arriving and placed is not AtDoor.UNSEEN:  # judged as it was accepted, its bytes all there then
                _connection.placed = AtDoor.UNSEEN
                _connection.in_line = placed is AtDoor.IN_LINE
                return placed
            if arriving:
                _connection.in_line = False
                outcome = at_accept(sock, waited_s, arriving=True, arrived_at=arrived)
                _connection.in_line = outcome is AtDoor.IN_LINE
            else:
                outcome = at_accept(sock, waited_s, in_line=getattr(_connection, "in_line", False),
                                    arrived_at=arrived)
            return outcome
        except Exception:
            logging.getLogger("llmb.web").exception("the door at accept failed on a request; it goes the usual way")
            return AtDoor.USUAL

    def caller(self, sock: Any) -> str:
        """Who sends the request on ``sock``, as the door counts callers ("" when it cannot tell)."""
        try:
            return "" if self.at_accept is None else self.at_accept.caller(sock)
        except Exception:
            logging.getLogger("llmb.web").exception("the door at accept failed on a request; it goes the usual way")
            return ""


class _TimedServer(StreamServer):
    """gevent's StreamServer, accepting in batches and noting each connection's accept time (in its process's
    ``arrivals``, set on the subclass its worker makes).

    A connection accepted before its client wrote anything (a pooled client connects first and writes later) gets
    no greenlet until its first bytes come: its socket is watched by the event loop itself, and its request is
    judged there as it arrives, as one whose bytes came with the connection is judged at accept. With a greenlet
    waiting on each, a burst's arrivals were judged one greenlet at a time, each behind the admitted calls that the
    greenlets before it had just let in: in a burst of 3,000 calls from one aiohttp session, refusals left 0.2-0.5 s
    after their request arrived, 5 ms from a client whose bytes came with its connections."""

    max_accept = property(lambda self: ACCEPT_BATCH, lambda self, value: None)  # gunicorn's 1 is ignored
    arrivals: Arrivals
    first_byte_s = 10.0  # how long a new connection's first byte is waited for (the header timeout), then closed

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._starting: deque[tuple[object, Callable[..., Any], tuple[Any, ...]]] = deque()  # accepted, to start
        self._pumping = False  # _start_in_turn is running
        # socket -> its read and time-out watchers, accept time and handler arguments: no bytes yet
        self._awaiting: dict[Any, tuple[tuple[Any, Any], float, tuple[Any, ...]]] = {}
        self._pool_spawn = self._spawn  # close() drops it from the server: what is started after goes in the pool
        if self.pool is not None:
            self.full = self._full

    def _full(self) -> bool:
        """The pool's bound, counting the connections accepted and not in it yet (awaiting their first bytes or
        their turn to start): each will take a place in it. A client holding connections open without writing is
        bounded as one holding greenlets was."""
        assert self.pool is not None
        return bool(self.pool.free_count() <= len(self._awaiting) + len(self._starting))

    def do_handle(self, *args: Any) -> None:
        accepted_at, arrivals = time.monotonic(), self.arrivals
        placed = AtDoor.UNSEEN
        if arrivals.at_accept is not None:
            placed = arrivals.judged(args[0], accepted_at=accepted_at)
            if placed:  # refused: answered from its bytes
                self._close_refused(args)
                return
            if placed is AtDoor.UNSEEN and connections.first_byte(args[0]) is None:
                self._await_first_bytes(accepted_at, args)
                return
        self._admit(accepted_at, accepted_at, placed, args)

    def _admit(self, accepted_at: float, arrived: float, placed: AtDoor, args: tuple[Any, ...]) -> None:
        """Start the connection's greenlet: in turn if the door let its call in by its line, else at once."""
        token = object()
        handle, unstarted = self._handle, self.arrivals.unstarted

        def timed(*a: Any) -> Any:
            unstarted.pop(token, None)
            _connection.accepted_at = accepted_at
            _connection.placed = placed
            return handle(*a)

        unstarted[token] = arrived
        if placed is AtDoor.IN_LINE or (self.pool is not None and self.pool.full()):  # no place now: in turn
            self._starting.append((token, timed, args))
            if not self._pumping:
                self._pumping = True
                gevent.spawn(self._start_in_turn)
            return
        self._start(token, timed, args)

    def _close_refused(self, args: tuple[Any, ...]) -> None:
        if connections.unread(args[0]):  # requests pipelined behind the refused one: a lingering close
            gevent.spawn(self._linger_then_close, *args)
        else:
            self.do_close(*args)

    def _await_first_bytes(self, accepted_at: float, args: tuple[Any, ...]) -> None:
        """Watch a connection with nothing to read yet, from the event loop (:meth:`_first_bytes`); closed quietly
        if nothing comes within :attr:`first_byte_s`, as a greenlet waiting for it would close it."""
        loop = gevent.get_hub().loop
        readable, expiry = loop.io(args[0].fileno(), 1), loop.timer(self.first_byte_s)
        self._awaiting[args[0]] = ((readable, expiry), accepted_at, args)
        readable.start(self._first_bytes, accepted_at, args)
        expiry.start(self._no_first_bytes, args)

    def _unwatch(self, sock: Any) -> bool:
        """Stop watching ``sock`` for its first bytes (False: it was not watched)."""
        awaiting = self._awaiting.pop(sock, None)
        for watcher in awaiting[0] if awaiting else ():
            watcher.stop()
            watcher.close()
        return awaiting is not None

    def _first_bytes(self, accepted_at: float, args: tuple[Any, ...]) -> None:
        """In the event loop: the first bytes came. The request is judged as at accept, arriving when they did
        (the kernel's stamp); if they are not all of it, its greenlet judges it as the rest comes."""
        if not self._unwatch(args[0]):
            return
        try:
            arrived = max(accepted_at, connections.first_byte(args[0]) or time.monotonic())
            placed = self.arrivals.judged(args[0], accepted_at=arrived)
            if placed:
                self._close_refused(args)
            else:
                self._admit(accepted_at, arrived, placed, args)
        except Exception:
            logging.getLogger("llmb.web").exception("a connection's first bytes could not be taken in; closing it")
            self.do_close(*args)
        self._accept_again()

    def _no_first_bytes(self, args: tuple[Any, ...]) -> None:
        if self._unwatch(args[0]):
            self.do_close(*args)
            self._accept_again()

    def _accept_again(self) -> None:
        """A place that a connection awaiting its bytes held is free: accepting resumes if it stopped for want of
        one (not while it backs off after an accept error)."""
        if self._watcher is None and self._timer is None and not self.closed:
            self._start_accepting_if_started()

    def close(self) -> None:
        """Stop accepting; the connections still awaiting their first bytes get their greenlets, which wait for
        them as the worker stops (their clients connected to send a request)."""
        for sock, (_, accepted_at, args) in list(self._awaiting.items()):
            self._unwatch(sock)
            self._admit(accepted_at, accepted_at, AtDoor.UNSEEN, args)
        super().close()

    def _start(self, token: object, timed: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._pool_spawn(_handle_and_close_when_done, timed, self.do_close, args)
        except BaseException:
            self.arrivals.unstarted.pop(token, None)
            self.do_close(*args)
            raise

    def _start_in_turn(self) -> None:
        """Start the greenlets of the calls let in by their line as their connections were accepted,
        :data:`START_BATCH` per pass of the event loop over what it has ready (each greenlet waits for the others
        ready before it, in the order they became ready). Spawned at once, a burst's thousand let in were all ahead
        of anything that became ready after them: the admission rounds (whose slot at the gate, connection from a
        pool or token at intake is handed on by the event loop) waited 0.3-0.9 s at each step, behind every one of
        them, while the device sat idle. Any other connection starts at once: a light caller's, one whose bytes
        were only partly there when it was judged (it waits for the rest), one that is no inference call. Its
        arrival is its accept (or its first byte's stamp, if later), not its start: the wait here counts against
        its deadline and the door's delay."""
        starting = self._starting
        try:
            while starting:
                for _ in range(min(START_BATCH, len(starting))):
                    self._start(*starting.popleft())
                gevent.sleep(0)
        finally:
            self._pumping = False

    def _linger_then_close(self, *args: Any) -> None:
        connections.linger_close(args[0])
        self.do_close(*args)


class _HeldHeaders:
    """A response's socket that holds the headers back (:meth:`hold`) to send them with the next write, and gives up
    on a client that takes no bytes for ``send_timeout_s`` (0: never)."""

    def __init__(self, sock: Any, send_timeout_s: float = 0.0) -> None:
        self.sock = sock
        self.send_timeout_s = send_timeout_s
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
            send_all(self.sock, held + data, self.send_timeout_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def send_all(sock: Any, data: bytes, timeout_s: float) -> None:
    """``sock.sendall(data)``, each wait for the client to take bytes at most ``timeout_s`` (0: no limit); a client
    that took none for that long is gone to this process: BrokenPipeError (EPIPE: gunicorn closes the connection
    quietly and closes the response's iterator)."""
    if timeout_s <= 0:
        sock.sendall(data)
        return
    view, before = memoryview(data), sock.gettimeout()
    try:
        sock.settimeout(timeout_s)  # a gevent socket's send waits for room at most this long, each time
        while view:
            view = view[sock.send(view):]
    except TimeoutError:
        logging.getLogger("llmb.web").info("a client took no bytes of its response for %g s: closing its connection",
                                           timeout_s)
        raise BrokenPipeError(errno.EPIPE, f"the client took no bytes for {timeout_s:g} s") from None
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(before)


class _OneWriteResponse(wsgi.Response):
    """gunicorn's response, its headers sent with the first piece of its body in one write; a 408 or 413 ends
    the connection (:data:`CLOSING_STATUSES`); a client that stops reading ends it (:func:`send_all`)."""

    send_timeout_s = 0.0  # set by the worker from its settings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sock = _HeldHeaders(self.sock, self.send_timeout_s)  # type: ignore[has-type]

    def start_response(self, status: str, headers: Any, exc_info: Any = None) -> Any:
        write = super().start_response(status, headers, exc_info)
        if self.status_code in CLOSING_STATUSES:
            self.force_close()
        return write

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


def _remembering(get_parser: Callable[..., Any]) -> Callable[..., Any]:
    """gunicorn's ``http.get_parser``, noting the connection's parser where :meth:`ArrivalTimingWorker.timeout_ctx`
    finds it (to see the bytes it has read ahead: a pipelined request needs no wait)."""
    def get(*args: Any, **kwargs: Any) -> Any:
        parser = _connection.parser = get_parser(*args, **kwargs)
        return parser
    return get


def _arrived(at: float) -> None:
    _connection.seen_at = at


_IS_OWNED = threading.Condition._is_owned  # type: ignore[attr-defined]


def _held(condition: threading.Condition) -> bool:
    """``threading.Condition._is_owned`` for a plain lock: whether it is held, without trying to take it (a lock
    with no ``locked()`` is asked as the standard library does)."""
    locked = getattr(condition._lock, "locked", None)  # type: ignore[attr-defined]
    return _IS_OWNED(condition) if locked is None else bool(locked())


class ArrivalTimingWorker(GeventWorker):
    settings: Settings
    arrivals: Arrivals

    def patch(self) -> None:
        """gunicorn's monkey-patching, and one fix to it. A ``threading.Condition`` on a plain lock (every
        ``queue.Queue``: the Redis and broker connection pools; every ``threading.Semaphore``: the gate's slots)
        checks that its caller holds the lock, on every notify and wait, by trying to take it without blocking;
        and gevent's lock, tried without blocking while held, yields to the event loop. Each connection taken or
        given back, and each slot at the gate given back, then waited for everything else the process had ready:
        traced in a burst of 3,000 calls, giving a call's slot back took 0.31 s, the first admission round 0.5-0.9
        s, while the device sat idle. The check here is the same (held, by anyone: a plain lock has no owner)
        without the attempt."""
        super().patch()
        threading.Condition._is_owned = _held  # type: ignore[attr-defined]

    def run(self) -> None:
        # the app's (create_app's), loaded by now: its door reads the backlog this worker keeps
        found = getattr(self.wsgi, "extensions", {}).get(ARRIVALS)
        self.arrivals = found if isinstance(found, Arrivals) else Arrivals()
        self.arrivals.intake = Intake()
        # gunicorn's run() builds its servers, and each request its response, from these names (this process only)
        self.settings = Settings.from_env()
        ggevent.StreamServer = type("TimedServer", (_TimedServer,),
                                    {"arrivals": self.arrivals, "first_byte_s": self.settings.web.header_timeout_s})
        wsgi.Response = type("OneWriteResponse", (_OneWriteResponse,),
                             {"send_timeout_s": self.settings.web.stream_send_timeout_s})
        http.get_parser = _remembering(http.get_parser)
        gunicorn_util.write_error = self._write_error  # its own errors, in JSON
        gevent.spawn(self._close_idle_when_stopping)
        for listener in self.sockets:
            connections.stamp_arrivals(listener)
        super().run()

    def _close_idle_when_stopping(self) -> None:
        while self.alive:
            gevent.sleep(0.2)
        # A pooled client's next request on a kept-alive connection is answered with Connection: close for a
        # moment (the server closing an idle connection races the client sending on it: a reset, or "server
        # disconnected"); only the connections idle through it are closed.
        gevent.sleep(connections.STOP_GRACE_S)
        connections.IDLE.stop()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        _connection.client, _connection.parser, _connection.requests, _connection.path = client, None, 0, None
        super().handle(listener, client, addr)

    def timeout_ctx(self) -> connections.NextRequest:
        """The wait for the connection's next request: the idle keep-alive for its first byte (a new connection's
        first request: the header timeout), then the header timeout (:mod:`webapp.connections`)."""
        first = _connection.requests == 0
        _connection.requests += 1
        idle = self.settings.web.header_timeout_s if first else self.settings.web.keepalive_s
        return connections.NextRequest(_connection.client, _connection.parser, idle, self.settings.web.header_timeout_s,
                                       self.settings.admission.body_timeout_s, _arrived, first=first,
                                       intake=self.arrivals.intake,
                                       refuse=self.arrivals.judged if self.arrivals.at_accept is not None else None,
                                       caller=self.arrivals.caller)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> Any:
        _connection.path = getattr(req, "path", None)
        try:
            return super().handle_request(listener_name, req, sock, addr)
        except StopIteration:  # the answer said Connection: close
            connections.linger_close(sock)
            raise

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        _connection.path = getattr(req, "path", None) or getattr(getattr(exc, "req", None), "path", None)
        super().handle_error(req, client, addr, exc)

    @staticmethod
    def _write_error(sock: Any, status_int: int, reason: str, mesg: str) -> None:
        connections.write_error(sock, status_int, reason, mesg, getattr(_connection, "path", None))


def placed_on_arrival() -> bool:
    """Whether the door let the request now being handled in by its place in its model's line as it arrived
    (:meth:`Arrivals.judged`); asked once per request (a pipelined request after it was not judged so)."""
    in_line = bool(getattr(_connection, "in_line", False))
    _connection.in_line = False
    return in_line


def arrival() -> tuple[float, float]:
    """When the request now being handled arrived, and when this process could first have got to it (monotonic).

    A request arrived when its first byte reached the host (the kernel's stamp), or at its connection's accept if
    that came later (its bytes waited in the accept queue with the connection); without a stamp, when the process
    saw it after waiting for it. A client that opens its connections and writes its requests later (seconds,
    for a busy client opening thousands at once) is not charged that time: not against its deadline, nor as the
    process's delay (:class:`webapp.door.Door`). A later request on a kept-alive connection arrived when its
    first byte came (now, without a stamp, when it was there already). Both times are the same now; the door's
    delay and the caller's deadline count from it."""
    accepted: float | None = getattr(_connection, "accepted_at", None)
    seen: float | None = getattr(_connection, "seen_at", None)
    _connection.accepted_at = _connection.seen_at = None
    at = arrived_at(accepted, seen)
    return at, at


def arrived_at(accepted: float | None, seen: float | None) -> float:
    """The arrival of a request whose connection was accepted at ``accepted`` (None: an earlier request's) and
    whose first byte came at ``seen`` (None: not known)."""
    if accepted is not None:
        return accepted if seen is None else max(accepted, seen)
    return time.monotonic() if seen is None else seen
