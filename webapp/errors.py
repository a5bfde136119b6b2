"""Every failure becomes JSON, mapped here once: exception -> status, type and message in :func:`exception_response`,
written in the body shape of the API family that was called (an :class:`ErrorShape`).

* native: ``{"error": {"type", "message", "request_id"}}``
* OpenAI-compatible: ``{"error": {"message", "type", "param", "code"}}`` (what the official client parses)

No HTML page and no stack trace ever reaches a caller: unexpected exceptions are logged and answered 500.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from flask import Blueprint, Flask, Response, current_app, g, jsonify
from werkzeug.exceptions import HTTPException

from tasks.errors import BatchingError

log = logging.getLogger("llmb.web")

HTTP_TYPES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
              413: "payload_too_large", 415: "unsupported_media_type"}


OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 408: "timeout", 409: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout"}


def error_body(type_: str, message: str, request_id: str | None) -> dict[str, object]:
    """The shape of every error of the native API."""
    return {"error": {"type": type_, "message": message, "request_id": request_id}}


def openai_error_body(status: int, code: str, message: str) -> dict[str, object]:
    """The shape of every error of the OpenAI-compatible routes (what the official client parses)."""
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": None,
                      "code": code}}


@dataclass(frozen=True)
class ErrorShape:
    """How one API family writes an error: its body from (status, type, message, request id), and the type it
    gives an HTTP error raised by werkzeug."""

    body: Callable[[int, str, str, str | None], dict[str, object]]
    http_type: Callable[[int, HTTPException], str]


NATIVE = ErrorShape(body=lambda status, type_, message, request_id: error_body(type_, message, request_id),
                    http_type=lambda status, exc: HTTP_TYPES.get(status, "http_error"))
OPENAI = ErrorShape(body=lambda status, type_, message, request_id: openai_error_body(status, type_, message),
                    http_type=lambda status, exc: "invalid_request" if status == 400
                    else exc.name.lower().replace(" ", "_"))


def error_response(status: int, type_: str, message: str, retry_after_s: int | None = None,
                   shape: ErrorShape = NATIVE) -> Response:
    """The JSON error answer, noted on ``g`` for the request's log line and metrics."""
    g.error_type = type_
    response = jsonify(shape.body(status, type_, message, g.get("request_id")))
    response.status_code = status
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    return response


def exception_response(exc: Exception, shape: ErrorShape = NATIVE) -> Response:
    """The one mapping of an exception to its answer: a BatchingError says its own status and type, an
    HTTPException its code, anything else is a logged 500."""
    if isinstance(exc, BatchingError):
        if exc.replay_of:  # an idempotent retry answered with the first call's error: under the first's id
            g.request_id, g.replayed = exc.replay_of, True
        return error_response(exc.status, exc.type, exc.message, exc.retry_after_s, shape)
    if isinstance(exc, HTTPException):
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 413:
            message = f"request body larger than {current_app.config['MAX_CONTENT_LENGTH']} bytes"
        return error_response(status, shape.http_type(status, exc), message, shape=shape)
    log.exception("unhandled error", extra={"request_id": g.get("request_id")})
    return error_response(500, "internal_error", "internal error; the request id is in the server log", shape=shape)


def register_error_handlers(scope: Flask | Blueprint, shape: ErrorShape = NATIVE) -> None:
    """Answer ``scope``'s failures in ``shape``. Only the app catches every Exception (a blueprint's unexpected
    errors reach the app's handler)."""
    handler = partial(exception_response, shape=shape)
    scope.register_error_handler(BatchingError, handler)
    scope.register_error_handler(HTTPException, handler)
    if isinstance(scope, Flask):
        scope.register_error_handler(Exception, handler)
