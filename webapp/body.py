"""The one reader of request bodies, for every route (native, OpenAI, admin): bounded in size and in time, decoded
strictly, so that no body can cost a 500 or hold a connection for ever.

* Size: a Content-Length over ``max_body_bytes`` is refused (413) before a byte is read; a chunked body is
  counted as it arrives.
* Time: the whole body must arrive within ``body_timeout_s`` of the request's headers, else 408. Under gevent
  (gunicorn's gevent worker monkey-patches the socket module) a ``gevent.Timeout`` interrupts the read
  wherever it blocks; without gevent a watchdog thread shuts the socket's read side at the deadline, and the
  deadline is checked between reads where no socket is exposed (the Flask test client).
* Content: UTF-8 JSON only (RFC 8259). Malformed JSON, numbers that are no JSON number (NaN, Infinity, 1e400,
  an integer of more than 4,300 digits: :mod:`tasks.policy.strict_json`, naming the field), nesting too deep for
  the parser and lone UTF-16 surrogate escapes (``"\\ud800"``: valid JSON syntax, but no Unicode text, so they
  would break the first UTF-8 encode downstream) are refused with 400 and a message that says what is wrong and
  where. The surrogate check walks the value only when the raw bytes hold a ``\\ud8``-``\\udf`` escape: normal
  bodies pay one ``bytes.find``.
"""
from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from flask import g, request
from werkzeug.exceptions import ClientDisconnected, RequestTimeout

from tasks.config import Settings
from tasks.errors import InvalidInput, PayloadTooLarge
from tasks.policy import strict_json

CHUNK_BYTES = 64 * 1024
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
EXAMPLE = 'e.g. {"input": "hello"}'


def read_json(settings: Settings) -> Any:
    """The request's body as JSON; InvalidInput (400), PayloadTooLarge (413) or RequestTimeout (408) otherwise."""
    started = g.get("started") or time.monotonic()
    return parse_json(read_body(settings.admission.max_body_bytes, settings.admission.body_timeout_s, started))


def parse_json(raw: bytes) -> Any:
    """Strict JSON from raw bytes, without I/O: every malformed body is an InvalidInput naming its fault."""
    if not raw.strip():
        raise InvalidInput(f"the body is empty; send a JSON object, {EXAMPLE}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"the body is not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
                           "send JSON encoded as UTF-8") from None
    try:
        value = strict_json.loads(text)
    except strict_json.NotANumber as exc:
        where = f" in '{exc.path}'" if exc.path else ""
        raise InvalidInput(f"the body holds {exc.shown}{where}, which is no JSON number this service reads: "
                           f"{exc.rule}") from None
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except RecursionError:
        raise InvalidInput("the body is nested too deeply to parse; requests need a flat JSON object, "
                           f"{EXAMPLE}") from None
    except ValueError as exc:  # none known: the parser's other refusals, said as it says them
        raise InvalidInput(f"the body is not valid JSON: {exc}") from None
    if b"\\u" in raw and SURROGATE_ESCAPE.search(raw):
        _check_unicode(value)
    return value


def _check_unicode(value: Any) -> None:
    """Refuse strings holding a lone surrogate (a valid pair was joined into one character by the parser)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"the body holds a lone UTF-16 surrogate escape (\\u{ord(exc.object[exc.start]):04x} "
                           "without its pair), which is no Unicode text; escape characters beyond U+FFFF as a "
                           "high-low pair, e.g. \\ud83d\\ude00") from None
    except RecursionError:
        raise InvalidInput(f"the body is nested too deeply; requests need a flat JSON object, {EXAMPLE}") from None


def read_body(max_bytes: int, timeout_s: float, started: float) -> bytes:
    """The raw body, at most ``max_bytes``, all of it within ``timeout_s`` of ``started`` (its headers)."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise PayloadTooLarge(f"request body larger than {max_bytes} bytes (Content-Length: {length})")
    parts: list[bytes] = []
    size = 0
    with time_limited(timeout_s, started) as check:
        stream: IO[bytes] = request.stream
        while chunk := stream.read(CHUNK_BYTES):
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(f"request body larger than {max_bytes} bytes")
            parts.append(chunk)
            check()
    return b"".join(parts)


@contextmanager
def time_limited(timeout_s: float, started: float) -> Iterator[Callable[[], None]]:
    """Every read of the request body inside must end within ``timeout_s`` of ``started``, else RequestTimeout
    (408): the one body deadline, for :func:`read_body` and for any other reader of a body (an upload's multipart
    parser). Yields a check to call between reads, for where no socket can be interrupted (the test client)."""
    deadline = started + timeout_s

    def check() -> None:
        if time.monotonic() >= deadline:
            raise _too_slow(timeout_s)

    expired: Callable[[], bool] = lambda: False  # noqa: E731  (until the limit is armed)
    try:
        with _time_limit(deadline) as expired:
            yield check
    except _Expired:
        raise _too_slow(timeout_s) from None
    except (ClientDisconnected, OSError):
        if expired():  # the watchdog shut the socket's read side: the body was too slow
            raise _too_slow(timeout_s) from None
        raise


def _too_slow(timeout_s: float) -> RequestTimeout:
    return RequestTimeout(f"the request body did not arrive within {timeout_s:g} s of its headers; "
                          "send the whole body at once (LLMB_BODY_TIMEOUT_S)")


class _Expired(Exception):
    """The gevent timer of one body read fired (converted to a 408 by :func:`read_body`)."""


@contextmanager
def _time_limit(deadline: float) -> Iterator[Callable[[], bool]]:
    """Interrupts a body read still blocked at ``deadline``; yields a function telling whether it did."""
    remaining = max(0.001, deadline - time.monotonic())
    if _gevent_patched():
        import gevent

        timer = gevent.Timeout(remaining)
        timer.start()
        try:
            yield lambda: False
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            raise _Expired() from None
        finally:
            timer.close()
        return
    sock = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    if not isinstance(sock, socket.socket):
        yield lambda: time.monotonic() >= deadline
        return
    shut = threading.Event()

    def shut_read_side() -> None:
        shut.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)  # the blocked read returns; the answer (408) can still be written

    watchdog = threading.Timer(remaining, shut_read_side)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield shut.is_set
    finally:
        watchdog.cancel()


def _gevent_patched() -> bool:
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey

    return bool(monkey.is_module_patched("socket"))
