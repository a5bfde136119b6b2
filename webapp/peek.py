"""Reading a request off a new connection without taking it: the raw HTTP peek the door refuses from, before
gunicorn parses anything."""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass

PEEK_MAX_BYTES = 16_384  # a body the door may read to find its tenant: a small one, all there already
PEEK_BYTES = PEEK_MAX_BYTES + 8192  # ... with its headers
_TENANT = re.compile(rb'"tenant"\s*:\s*"([^"\\]{1,64})"')


@dataclass(frozen=True)
class Peeked:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    size: int  # bytes of the whole request


def peek_request(sock: socket.socket) -> Peeked | None:
    """The request already arrived on a new connection, read without taking it off the socket (None: not all
    there, or not a plain POST with a Content-Length)."""
    data = _waiting_bytes(sock)
    end = -1 if data is None else data.find(b"\r\n\r\n")
    if data is None or end < 0:
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
    return Peeked(rest.split(" ", 1)[0].split("?", 1)[0], headers, data[end + 4:size], size)


def partly_arrived(sock: socket.socket) -> bool:
    """Whether the start of a request is there but not all of it yet (its body a moment behind its headers, as
    clients that write them separately send it)."""
    data = _waiting_bytes(sock)
    if not data or len(data) >= PEEK_BYTES:
        return False
    end = data.find(b"\r\n\r\n")
    return end < 0 or b"content-length" in data[:end].lower()


def _waiting_bytes(sock: socket.socket) -> bytes | None:
    """What has arrived on ``sock`` so far (up to PEEK_BYTES), left there; None when it cannot be read."""
    timeout = sock.gettimeout()
    try:
        sock.settimeout(0.0)
        return sock.recv(PEEK_BYTES, socket.MSG_PEEK)
    except OSError:
        return None
    finally:
        sock.settimeout(timeout)


def tenant_of(body: bytes) -> str:
    found = _TENANT.search(body) if len(body) <= PEEK_MAX_BYTES else None
    return found.group(1).decode("utf-8", "replace") if found else ""
