"""How an API process keeps, times and closes its HTTP/1.1 connections, as nginx and Go's net/http do.

gunicorn's gevent worker waits for each next request inside one ``gevent.Timeout(keepalive)`` and closes the
connection silently when it fires. That one number is both the idle keep-alive and the limit on a request's
headers, counted from the end of the previous response, so with its default of 5 s a pooled client (httpx
expires idle connections at 5 s) races the server's close and loses a call now and then; under load, when the
process gets to a connection late, a request already on its way is cut off ("Server disconnected",
"Connection reset by peer"). Here the wait is split in two:

* **idle** (:attr:`Settings.keepalive_s`, 75 s): waiting for the first byte of the next request, nothing is
  lost by closing, and the limit is longer than clients' pool expiry, so a pooled client retires an idle
  connection before the server does. A new connection's first request gets :attr:`Settings.header_timeout_s`.
* **headers** (:attr:`Settings.header_timeout_s`, 10 s): from a request's first byte (slow-header
  protection). A request whose headers do not all arrive in time is answered 408, never dropped. A request
  whose bytes are all there is never cut: the timer only fires while the parser waits for more bytes.

Every close that follows an answer (``Connection: close``, a 408, gunicorn's own 400/414/431 errors) is a
*lingering close*: the write side is shut, and what the client still sends is read and dropped for up to
:data:`LINGER_S`, so that the client reads the answer instead of a reset (closing a socket with unread bytes
makes the kernel send RST, and the client's kernel may then drop the answer it had not read yet).

When the worker stops, a request arriving on a kept-alive connection within :data:`STOP_GRACE_S` is answered
with ``Connection: close``, and the connections still idle then are closed (nothing is lost; a pooled client
opens another), so a graceful stop waits only for requests in progress and that moment.
"""
from __future__ import annotations

import contextlib
import json
import socket
import struct
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import gevent
import gevent.socket

from webapp.errors import NATIVE, shape_for
from webapp.intake import Intake

# On a graceful stop, idle kept-alive connections stay open this long: a request arriving on one is answered (with
# Connection: close) instead of racing the close. A connection still idle after it has been idle longer than httpx
# (the openai client) keeps one in its pool (5 s), so that client never sends on one as it is closed; others
# (urllib3, aiohttp) check a pooled connection for a close before they reuse it, and a pool under load reuses its
# connections well within it. With 1 s, 2 of 3,731 calls met a closing connection during a SIGHUP reload.
STOP_GRACE_S = 5.5
LINGER_S = 2.0  # most time a lingering close reads what the client still sends (nginx: lingering_timeout 5 s)
LINGER_BYTES = 1 << 20  # ... and at most this much of it

# gunicorn's own refusals (its parser's), as the JSON types of our error table
GUNICORN_TYPES = {400: "invalid_request", 403: "forbidden", 414: "uri_too_long", 417: "expectation_failed",
                  431: "headers_too_large", 501: "not_implemented"}


class AtDoor(Enum):
    """What the door at accept did with a request (true only when it answered it)."""

    USUAL = "usual"  # nothing: the request goes the usual way (gunicorn, the door middleware, Flask)
    REFUSED = "refused"  # answered from its bytes; the connection is closed
    IN_LINE = "in_line"  # let in by its place in its model's line: at its turn only lateness refuses it
    LIGHT = "light"  # a light caller's, on arrival: taken in at once, not behind the line at intake
    UNSEEN = "unseen"  # at its accept, not all of its bytes there yet: judged as they arrive

    def __bool__(self) -> bool:
        return self is AtDoor.REFUSED


class HeaderTimeout(Exception):
    """A request's headers did not all arrive within the header timeout of its first byte."""


class _Stopping(Exception):
    """The worker is stopping: an idle connection ends its wait."""


class IdleConnections:
    """The connections waiting for their next request, so that a stopping worker closes them at once.

    Each idle wait is on a read watcher of its own, and a stop cancels exactly those waits (gevent's
    ``cancel_wait``, which throws only into a greenlet still blocked on that watcher). Killing the waiting
    greenlets instead (``gevent.killall``, asynchronous) raced requests whose bytes had just come: the kill
    landed after the wait had ended, inside the request's handling, which then answered 500 or dropped the
    connection mid-request (5 calls of 5,793 during a SIGHUP reload, and a worker stuck until gunicorn's
    graceful timeout killed what it held)."""

    def __init__(self) -> None:
        self.stopping = False
        self._waiting: dict[gevent.Greenlet, Any] = {}  # greenlet -> the read watcher it waits on

    def wait(self, sock: socket.socket, timeout_s: float, kept: bool = True) -> float | None:
        """Wait until ``sock`` has bytes to read: when they arrived (monotonic: the kernel's stamp of the first
        byte, see :func:`stamp_arrivals`; without one, 0.0 when they were there already, or when they were seen),
        or None when ``timeout_s`` passed, the client closed or (a ``kept`` connection, idle after an answer) the
        worker stops. A new connection's first request is waited for even then: its client has connected to send
        it."""
        timeout = sock.gettimeout()
        try:
            sock.settimeout(0.0)
            try:
                got, stamp = _peek_stamped(sock)
                return stamp if got else None
            except BlockingIOError:
                pass
            if kept and self.stopping:
                return None
            if not self._readable(sock, timeout_s, kept):
                return None
            got, stamp = _peek_stamped(sock)
            return (stamp or time.monotonic()) if got else None
        except (_Stopping, OSError):  # a spurious wake-up (BlockingIOError) ends the connection as a time-out does
            return None
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(timeout)

    def _readable(self, sock: socket.socket, timeout_s: float, kept: bool) -> bool:
        """Block until ``sock`` is readable (True) or ``timeout_s`` passed (False); _Stopping when a stop cancels
        the wait of a ``kept`` connection."""
        watcher = gevent.get_hub().loop.io(sock.fileno(), 1)
        me = gevent.getcurrent()
        if kept:
            self._waiting[me] = watcher
        try:
            gevent.socket.wait(watcher, timeout=timeout_s, timeout_exc=_IdleTimeout)
            return True
        except _IdleTimeout:
            return False
        finally:
            self._waiting.pop(me, None)
            watcher.close()

    def stop(self) -> None:
        self.stopping = True
        for watcher in list(self._waiting.values()):
            gevent.socket.cancel_wait(watcher, _Stopping)


class _IdleTimeout(Exception):
    """An idle connection's wait for its next request ran out."""


IDLE = IdleConnections()

# SO_TIMESTAMPNS (Linux): each read carries the time its bytes reached the host, on the realtime clock
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_STAMP_SPACE = socket.CMSG_SPACE(16)


def stamp_arrivals(listener: socket.socket) -> None:
    """Have the kernel stamp the bytes of every connection ``listener`` accepts with their arrival time.

    A client that opens many connections at once and writes its requests later (aiohttp does, and on a busy
    client the gap is seconds) would otherwise have its requests timed from the connection's accept, or from
    when this process got round to looking, neither of which is when the request came."""
    with contextlib.suppress(OSError):
        listener.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)


def _peek_stamped(sock: socket.socket) -> tuple[bool, float]:
    """Whether a byte is there to read (without taking it), and when it arrived (monotonic; 0.0 when the kernel
    gave no stamp)."""
    data, ancillary, _, _ = sock.recvmsg(1, _STAMP_SPACE, socket.MSG_PEEK)
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
            seconds, nanoseconds = struct.unpack("qq", raw[:16])
            return bool(data), time.monotonic() - (time.time() - (seconds + nanoseconds / 1e9))
    return bool(data), 0.0


def first_byte(sock: socket.socket) -> float | None:
    """When the first byte waiting on a new connection reached the host (monotonic: the kernel's stamp, else now),
    or None when nothing has come yet. A connection the client closed or reset has something to see (its end): now."""
    timeout = sock.gettimeout()
    try:
        sock.settimeout(0.0)
        _, stamp = _peek_stamped(sock)
        return stamp or time.monotonic()
    except BlockingIOError:
        return None
    except OSError:
        return time.monotonic()
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(timeout)


class NextRequest:
    """The wait for one request on a connection (gunicorn's ``timeout_ctx``): the idle wait for its first byte on
    entry (StopIteration ends the connection quietly when none comes), then the header timer until the parser
    has the request; when the timer fires the request is answered 408 and the connection closed (lingering).

    A request whose first byte had to be waited for is said to arrive (``arrived``) when it was seen: a client
    that connects and sends later (a busy client opening many connections at once) is not charged that time
    as the process's own delay (:class:`webapp.door.Door`)."""

    def __init__(self, sock: socket.socket, parser: Any, idle_s: float, header_s: float, body_s: float,
                 arrived: Callable[[float], None], first: bool = False, intake: Intake | None = None,
                 refuse: Callable[[socket.socket, float | None, bool], AtDoor] | None = None,
                 caller: Callable[[socket.socket], str] = lambda sock: "") -> None:
        self.sock = sock
        self.intake = intake
        self.refuse = refuse  # the door judging from the bytes (webapp.accept_door.AcceptDoor): true if it answered
        self.caller = caller  # who sends the request on a socket, as the door counts callers (its line at intake)
        self.first = first
        self.parser = parser  # gunicorn's RequestParser of the connection
        self.body_s = body_s
        self.arrived = arrived
        self.idle_s = idle_s
        self.header_s = header_s
        self.timer: gevent.Timeout | None = None
        self.expired = HeaderTimeout()
        self.held = False  # the parser held this request's bytes (pipelined): the door at the socket steps aside

    def __enter__(self) -> NextRequest:
        # what the app left unread of the previous body (a refusal before reading it) is read and dropped first,
        # under the body's own time limit: the header timer starts at the next request's first byte
        if not self.parser.finish_body(deadline=time.monotonic() + self.body_s):
            raise StopIteration("the previous body did not end in time")
        # a pipelined request the parser already holds (some or all of it) is not what the socket's bytes are: they
        # are a later request's, or this one's rest. The door steps aside for it: it is taken in at the process's
        # pace and judged once parsed, as any request is (webapp.door.DoorMiddleware), never by another's bytes
        self.held = self._buffered() > 0
        if not self.held:
            seen = IDLE.wait(self.sock, self.idle_s, kept=not self.first)
            if seen is None:
                raise StopIteration("idle")  # gunicorn's keep-alive loop closes the connection
            if seen:
                self.arrived(seen)  # when it came (the kernel's stamp), or when the process saw it
        if self.intake is not None:
            # a request that would wait too long, or that its model's line cannot answer in time, is refused now,
            # from its bytes, not after its turn and a full parse; the others are taken in at the process's pace,
            # each caller's in arrival order, the callers in turn, and a light caller's at once: beside a flood's
            # line its call would otherwise wait out the flood's turns (up to a second, measured), and light
            # callers are few by definition
            light = self._refuse_if_behind(None) is AtDoor.LIGHT
            waited = None if light else self.intake.take(lambda: "" if self.held else self.caller(self.sock))
            if waited is not None:
                try:  # it waited in line: its turn may have come later than the door allows
                    self._refuse_if_behind(waited)
                except StopIteration:
                    self.intake.give_back()  # a refusal is one write: the next in line need not wait a tick
                    raise
        self.timer = gevent.Timeout(self.header_s, self.expired)
        self.timer.start()
        return self

    def _refuse_if_behind(self, waited_s: float | None) -> AtDoor:
        """Let the door refuse the request from its bytes: as it arrives (None: by its place in its model's line,
        and by the line ahead of it in this process), or by the time it waited for its turn; what it did. Not a
        request the parser holds (:attr:`held`): the socket's bytes are not its own."""
        if self.refuse is None or self.held:
            return AtDoor.USUAL
        outcome = self.refuse(self.sock, waited_s, waited_s is None)
        if outcome:
            if unread(self.sock):  # pipelined requests behind it: closing now would reset the connection
                linger_close(self.sock)
            raise StopIteration("refused from its bytes")
        return outcome

    def _buffered(self) -> int:
        """Bytes of the next request the parser has already read ahead (a pipelined request: no wait)."""
        buf = getattr(getattr(self.parser, "unreader", None), "buf", None)
        return buf.getbuffer().nbytes if buf is not None else 0

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        assert self.timer is not None
        self.timer.close()
        if exc is not self.expired:
            return False
        write_error(self.sock, 408, "Request Timeout",
                    f"the request's headers did not all arrive within {self.header_s:g} s of its first byte "
                    "(LLMB_HEADER_TIMEOUT_S)")
        return True  # no request: gunicorn ends the connection


def unread(sock: socket.socket) -> bool:
    """Whether the client sent bytes nothing has read (requests pipelined behind one the door refused and took off
    the socket): closing now would send RST, and the client might lose the refusal, so the close must linger."""
    timeout = sock.gettimeout()
    try:
        sock.settimeout(0.0)
        return bool(sock.recv(1, socket.MSG_PEEK))
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(timeout)


def linger_close(sock: socket.socket) -> None:
    """Shut the write side (the answer is out) and read what the client still sends, for a while, so that closing
    then sends FIN, not a reset that could destroy the answer before the client reads it."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return
    deadline, read = time.monotonic() + LINGER_S, 0
    try:
        while read < LINGER_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with gevent.Timeout(left, False):
                chunk = sock.recv(65536)
            if not chunk:  # the client closed (it read the answer), or the timer ended the read
                return
            read += len(chunk)
    except OSError:
        return


def error_bytes(status: int, reason: str, message: str, path: str | None = None) -> bytes:
    """A whole HTTP/1.1 error answer with its JSON body, ending the connection."""
    type_ = "request_timeout" if status == 408 else GUNICORN_TYPES.get(status, "internal_error")
    shape = NATIVE if path is None else shape_for(path)
    body = json.dumps(shape.body(status, type_, message or reason, None)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


def write_error(sock: socket.socket, status: int, reason: str, message: str, path: str | None = None) -> None:
    """Answer an error the server itself raises before the app (gunicorn's parser, the header timeout) in JSON,
    then close lingering. A 500 from here never carries the exception's text."""
    if status >= 500 and status != 501:
        message = "internal error; see the server log"
    try:
        sock.sendall(error_bytes(status, reason, message, path))
    except OSError:
        return
    linger_close(sock)
