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
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/infer")
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
MAX_CUSTOM_ID = 512
MAX_ERRORS = 100  # validation errors reported (the rest are counted in the last one)


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
    """A line of the input file that is not a valid request (OpenAI's batch ``errors.data`` entry)."""

    line: int  # 1-based line number in the file
    code: str
    message: str
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def parse_input(lines: Iterable[bytes], endpoint: str, max_lines: int) -> tuple[list[InputLine], list[LineError]]:
    """Every request of a batch input file, or what is wrong with it (at most MAX_ERRORS errors, then a count).

    Each non-blank line must be a JSON object with a unique non-empty string ``custom_id``, ``"method": "POST"``,
    ``url`` equal to the batch's ``endpoint`` and an object ``body``; the body itself is checked when the line
    runs (an invalid one is that line's 400 in the error file)."""
    found: list[InputLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    extra = 0
    requests = 0

    def bad(number: int, code: str, message: str, param: str | None = None) -> None:
        nonlocal extra
        if len(errors) < MAX_ERRORS:
            errors.append(LineError(number, code, message, param))
        else:
            extra += 1

    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        requests += 1
        if requests > max_lines:
            bad(number, "too_many_requests", f"the file holds more than {max_lines} requests (LLMB_JOBS_MAX_LINES)")
            break
        try:
            value = _DECODER.decode(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            bad(number, "invalid_json_line", f"line {number} is not valid UTF-8 JSON ({exc})")
            continue
        if not isinstance(value, dict):
            bad(number, "invalid_request", f"line {number} is not a JSON object")
            continue
        custom_id, method, url, body = (value.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            bad(number, "invalid_request", f"'custom_id' must be a string of 1-{MAX_CUSTOM_ID} characters",
                "custom_id")
        elif custom_id in seen:
            bad(number, "duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line", "custom_id")
        elif method != "POST":
            bad(number, "invalid_request", "'method' must be \"POST\"", "method")
        elif url != endpoint:
            bad(number, "mismatched_endpoint", f"'url' is {url!r}, but the batch's endpoint is {endpoint!r}",
                "url")
        elif not isinstance(body, dict):
            bad(number, "invalid_request", "'body' must be a JSON object (the request's body)", "body")
        else:
            found.append(InputLine(len(found), custom_id, body))
        if isinstance(custom_id, str):
            seen.add(custom_id)
    if not found and not errors:
        errors.append(LineError(0, "empty_file", "the input file holds no request"))
    if extra:
        errors.append(LineError(0, "more_errors", f"{extra} more line(s) are invalid"))
    return found, errors


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
