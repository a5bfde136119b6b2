"""The Batch API's file formats and identifiers (pure): OpenAI's batch input lines in, its output lines out.

Input, one JSON object a line::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output (the output file holds the lines answered 200, the error file the others), one JSON object a line::

    {"id": "batch_req_...", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A line that never ran (its batch was cancelled or expired first) has ``"response": null`` and an ``error`` with a
``code`` and a ``message``. Every identifier here is deterministic where it must be: a line's request id (its
correlation id in the ledger) and its output id derive from the job and the line, so a line run again after a
crash writes the same line.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import secrets
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from tasks.errors import InvalidInput
from tasks.policy import strict_json
from tasks.schema import json_integer

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/infer")
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
MAX_CUSTOM_ID = 512
MAX_ERRORS = 100  # validation errors reported (the rest are counted in the last one)
MAX_MESSAGE = 300  # characters of one error's message
MAX_SHOWN = 64  # characters of a tenant's value quoted in an error message
LINE_ENVELOPE_BYTES = 8 * 1024  # a line's room around its body: custom_id, method, url
SKIP_CHUNK = 1024 * 1024  # a line over the limit is skipped this much at a time
MAX_FILENAME = 255
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600  # OpenAI's bounds of expires_after.seconds
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def new_id(prefix: str, now: float) -> str:
    """A unique id that sorts by creation time (lists are ordered by id): ``prefix`` + ms time + random."""
    return f"{prefix}{int(now * 1000):012x}{secrets.token_hex(8)}"


def line_request_id(job_id: str, line_no: int) -> str:
    """The request id of a job's line, the same on every run of it: its correlation id in the ledger."""
    return f"{job_id}-{line_no}"


def idempotency_key(job_id: str, custom_id: str) -> str:
    """A key naming one line of one job, for a gateway that answers a repeated key with its first answer."""
    return hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()


def output_file_id(job_id: str, kind: str) -> str:
    """The id of a job's output ("output") or error ("error") file: fixed, so writing it again replaces it."""
    return f"file-{job_id.removeprefix('batch_')}-{kind}"


@dataclass(frozen=True)
class InputLine:
    line_no: int  # 0-based, in file order (blank lines skipped)
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    """A line of the input file that is not a valid request (OpenAI's batch ``errors.data`` entry). Its message
    is at most MAX_MESSAGE characters: a job's errors are shown in every listing of its tenant's batches."""

    line: int  # 1-based line number in the file
    code: str
    message: str
    param: str | None = None

    def __post_init__(self) -> None:
        if len(self.message) > MAX_MESSAGE:
            object.__setattr__(self, "message", self.message[:MAX_MESSAGE - 1] + "\u2026")

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def shown(value: Any) -> str:
    """A tenant's value as an error message quotes it: a string's repr, cut to MAX_SHOWN characters (a 200 KB
    ``url`` must not make a 200 KB message), anything else by its JSON type only."""
    if not isinstance(value, str):
        return {dict: "an object", list: "an array", bool: "a boolean", type(None): "null"}.get(
            type(value), "a number")
    if len(value) <= MAX_SHOWN:
        return repr(value)
    return f"{value[:MAX_SHOWN]!r}\u2026 ({len(value)} characters)"


def read_lines(source: IO[bytes], max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based number, bytes) of every line of ``source``, holding at most ``max_bytes`` of it at a time: a
    longer line is given as None and skipped to its end, so a file's size never becomes memory."""
    number = 0
    while raw := source.readline(max_bytes + 1):
        number += 1
        if len(raw) <= max_bytes or (raw.endswith(b"\n") and len(raw) == max_bytes + 1):
            yield number, raw
            continue
        while not raw.endswith(b"\n") and (raw := source.readline(SKIP_CHUNK)):
            pass
        yield number, None


def _body_bytes(body: dict[str, Any]) -> int | None:
    """A body's size as the smallest JSON a client could send it as (what an interactive call's limit counts);
    None when it is nested too deeply to be written again."""
    try:
        return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    except RecursionError:
        return None


def _key(custom_id: str) -> bytes:
    """What a custom_id is remembered by while the file is read: 16 bytes whatever its length."""
    return hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class InputCheck:
    """One pass over a batch input file: :meth:`lines` yields its valid requests one at a time and notes what is
    wrong with the others (at most MAX_ERRORS, then a count), so memory is bounded by one line (at most
    ``max_body_bytes`` + LINE_ENVELOPE_BYTES) and the custom_ids seen (16 bytes each, at most ``max_lines``),
    whatever the file's size.

    Each non-blank line must be a JSON object with a unique non-empty string ``custom_id``, ``"method": "POST"``,
    ``url`` equal to the batch's ``endpoint`` and an object ``body`` of at most ``max_body_bytes`` (the limit of
    an interactive call's body, ``LLMB_MAX_BODY_BYTES``); the body itself is checked when the line runs, as its
    endpoint checks an interactive call's (an invalid one is that line's 400 in the error file)."""

    def __init__(self, endpoint: str, max_lines: int, max_body_bytes: int) -> None:
        self.endpoint = endpoint
        self.max_lines = max_lines
        self.max_body_bytes = max_body_bytes
        self.errors: list[LineError] = []
        self.left_out = 0  # errors beyond MAX_ERRORS, counted only
        self.requests = 0  # non-blank lines read
        self._seen: set[bytes] = set()

    def report(self) -> list[LineError]:
        """What is wrong with the file (empty: nothing): the first MAX_ERRORS faults, then one saying how many
        more there were; or that it holds no request at all."""
        if self.errors:
            more = [LineError(0, "more_errors", f"{self.left_out} more line(s) are invalid")] if self.left_out else []
            return self.errors + more
        if not self.requests:
            return [LineError(0, "empty_file", "the input file holds no request")]
        return []

    def _bad(self, number: int, code: str, message: str, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(LineError(number, code, message, param))
        else:
            self.left_out += 1

    def lines(self, source: IO[bytes]) -> Iterator[InputLine]:
        """The file's valid requests, in order (numbered from 0); the faults of the others go to :meth:`report`."""
        found = 0
        for number, raw in read_lines(source, self.max_body_bytes + LINE_ENVELOPE_BYTES):
            if raw is not None and not raw.strip():
                continue
            self.requests += 1
            if self.requests > self.max_lines:
                self._bad(number, "too_many_requests",
                          f"the file holds more than {self.max_lines} requests (LLMB_JOBS_MAX_LINES)")
                return
            line = self._check(number, raw)
            if line is not None:
                yield InputLine(found, *line)
                found += 1

    def _check(self, number: int, raw: bytes | None) -> tuple[str, dict[str, Any]] | None:
        if raw is None:
            self._bad(number, "line_too_large", f"line {number} is longer than {self.max_body_bytes} bytes "
                      f"(LLMB_MAX_BODY_BYTES, an interactive call's limit) and {LINE_ENVELOPE_BYTES} more for its "
                      "custom_id, method and url", "body")
            return None
        try:
            value = strict_json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            self._bad(number, "invalid_json_line", f"line {number} is not valid UTF-8 JSON ({exc})")
            return None
        except RecursionError:
            self._bad(number, "invalid_json_line", f"line {number} is nested too deeply to parse")
            return None
        return self._request(number, value)

    def _request(self, number: int, value: Any) -> tuple[str, dict[str, Any]] | None:
        if not isinstance(value, dict):
            self._bad(number, "invalid_request", f"line {number} is not a JSON object")
            return None
        custom_id, method, url, body = (value.get(k) for k in ("custom_id", "method", "url", "body"))
        key = _key(custom_id) if isinstance(custom_id, str) else None
        try:
            if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
                self._bad(number, "invalid_request", f"'custom_id' must be a string of 1-{MAX_CUSTOM_ID} characters",
                          "custom_id")
            elif _UNSTORABLE.search(custom_id):
                self._bad(number, "invalid_request", "'custom_id' holds NUL or a lone UTF-16 surrogate escape, "
                          "which no output file line could give back as it was sent", "custom_id")
            elif key in self._seen:
                self._bad(number, "duplicate_custom_id", f"custom_id {shown(custom_id)} is used by an earlier line",
                          "custom_id")
            elif method != "POST":
                self._bad(number, "invalid_request", f"'method' must be \"POST\", not {shown(method)}", "method")
            elif url != self.endpoint:
                self._bad(number, "mismatched_endpoint", f"'url' is {shown(url)}, but the batch's endpoint is "
                          f"{self.endpoint!r}", "url")
            elif not isinstance(body, dict):
                self._bad(number, "invalid_request", "'body' must be a JSON object (the request's body)", "body")
            elif (size := _body_bytes(body)) is None:
                self._bad(number, "invalid_json_line", f"the body of line {number} is nested too deeply", "body")
            elif size > self.max_body_bytes:
                self._bad(number, "line_too_large", f"the body of line {number} is {size} bytes; a request's body "
                          f"may be at most {self.max_body_bytes} (LLMB_MAX_BODY_BYTES)", "body")
            else:
                return custom_id, body
            return None
        finally:
            if key is not None:
                self._seen.add(key)


def parse_input(lines: Iterable[bytes], endpoint: str, max_lines: int,
                max_body_bytes: int = 1_048_576) -> tuple[list[InputLine], list[LineError]]:
    """Every request of a small input held whole (for tests and tools: a job streams its file through
    :class:`InputCheck`), and what is wrong with it."""
    check = InputCheck(endpoint, max_lines, max_body_bytes)
    found = list(check.lines(io.BytesIO(b"".join(x if x.endswith(b"\n") else x + b"\n" for x in lines))))
    return found, check.report()


def check_filename(name: str) -> str:
    """An upload's filename as it is kept and given back in ``Content-Disposition``: at most 255 characters,
    no control character (CR/LF, ESC, ...: a header cannot hold them, and a terminal would run them)."""
    bad = next((c for c in name if _is_control(c)), None)
    if bad is not None:
        raise InvalidInput(f"the filename holds a control character ({bad!r}); name the file without line breaks, "
                           "tabs or escapes")
    if len(name) > MAX_FILENAME:
        raise InvalidInput(f"the filename is {len(name)} characters long; the limit is {MAX_FILENAME}")
    return name


def download_name(name: str) -> str:
    """A stored filename fit for a ``Content-Disposition`` header whatever it holds (files kept before
    :func:`check_filename` existed): each control character becomes ``_``."""
    return "".join("_" if _is_control(c) else c for c in name) or "file"


def _is_control(c: str) -> bool:
    return unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp")


def expiry_s(value: Any, field: str) -> int:
    """The seconds of an ``expires_after`` (OpenAI's: ``{"anchor": "created_at", "seconds": N}``, N from an hour
    to 30 days), checked."""
    if not isinstance(value, dict) or set(value) != {"anchor", "seconds"}:
        raise InvalidInput(f"'{field}' must be {{\"anchor\": \"created_at\", \"seconds\": N}}")
    if value["anchor"] != "created_at":
        raise InvalidInput(f"'{field}.anchor' must be \"created_at\" (the only anchor)")
    seconds = value["seconds"]
    if isinstance(seconds, str) and seconds.strip().isdigit() and len(seconds) < 12:
        seconds = int(seconds)  # multipart form fields are text
    seconds = json_integer(seconds)
    if seconds is None or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
        raise InvalidInput(f"'{field}.seconds' must be an integer from {MIN_EXPIRY_S} (1 hour) to {MAX_EXPIRY_S} "
                           "(30 days)")
    return seconds


def response_line(request_id: str, custom_id: str, status_code: int, body: Any) -> str:
    """One line of an output or error file for a line that ran (any status), JSON without a newline."""
    return json.dumps({"id": _line_id(request_id), "custom_id": custom_id,
                       "response": {"status_code": status_code, "request_id": request_id, "body": body},
                       "error": None})


def error_line(request_id: str, custom_id: str, code: str, message: str) -> str:
    """One line of an error file for a line that never ran (``batch_cancelled``, ``batch_expired``)."""
    return json.dumps({"id": _line_id(request_id), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}})


def _line_id(request_id: str) -> str:
    return "batch_req_" + hashlib.sha256(request_id.encode()).hexdigest()[:24]
