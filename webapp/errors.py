"""Every failure becomes JSON, mapped here once: exception -> status, type and message in :func:`exception_response`,
written in the body shape of the API family that was called (an :class:`ErrorShape`). Domain errors
(:mod:`tasks.errors`) are only a type and a message: :data:`STATUSES` is the one table of their HTTP statuses.

* native: ``{"error": {"type", "message", "request_id"}}``
* OpenAI-compatible: ``{"error": {"message", "type", "param", "code"}}`` (what the official client parses), for
  every path under ``/v1/`` but the native routes (:data:`NATIVE_ROUTES`): the OpenAI routes and the Batch API,
  and any path the openai client may try that is not served here (``/v1/responses``, ``/v1/audio/...``)

The family is chosen by path (:func:`shape_for`), not only by the blueprint that handled the request: a 404 or 405
found by routing, and an unexpected exception, belong to no blueprint's handler, yet the openai client calling
``DELETE /v1/chat/completions`` or ``GET /v1/batches/x/y`` parses its family's shape all the same.

No HTML page and no stack trace ever reaches a caller: unexpected exceptions are logged and answered 500.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.exceptions import NotFound as HTTPNotFound

from tasks.errors import (
    AdapterConflict,
    AdapterLimit,
    BatchingError,
    ContextLengthExceeded,
    DeadlineExceeded,
    Forbidden,
    IdempotencyConflict,
    IdempotencyInProgress,
    InferenceFailed,
    InvalidInput,
    ModelNotFound,
    NotFound,
    NotResumable,
    Overloaded,
    PayloadTooLarge,
    PoisonInput,
    QueueFull,
    QuotaExceeded,
    RecordUnreadable,
    RetriesExhausted,
    StorageFull,
    TenantOverLimit,
    Unauthorized,
    Unavailable,
)

log = logging.getLogger("llmb.web")

# The HTTP status of each domain error's type (tests/test_error_shapes.py checks that every type has one).
STATUSES: dict[str, int] = {
    InvalidInput.type: 400, ContextLengthExceeded.type: 400, Unauthorized.type: 401, Forbidden.type: 403,
    QuotaExceeded.type: 403, NotFound.type: 404, ModelNotFound.type: 404, IdempotencyConflict.type: 409,
    IdempotencyInProgress.type: 409, NotResumable.type: 409, RecordUnreadable.type: 409,
    PayloadTooLarge.type: 413, PoisonInput.type: 422, QueueFull.type: 429, TenantOverLimit.type: 429,
    Overloaded.type: 429, BatchingError.type: 500, InferenceFailed.type: 500, Unavailable.type: 503,
    RetriesExhausted.type: 503, DeadlineExceeded.type: 504, StorageFull.type: 507,
    AdapterConflict.type: 409, AdapterLimit.type: 403,
}


def status_of(type_: str) -> int:
    """The HTTP status of a domain error's type (an unknown one, a newer version's, is a 500)."""
    return STATUSES.get(type_, 500)


HTTP_TYPES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
              413: "payload_too_large", 415: "unsupported_media_type"}


OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 408: "timeout", 409: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout"}

# The native API under /v1: these paths and everything under them, matched or not; the rest of /v1 is OpenAI's
# (webapp.openai_api, webapp.batch_api, and what the openai client may ask for that is not served here).
# tests/test_error_shapes.py checks every route of the app against it.
NATIVE_ROUTES = ("/v1/infer", "/v1/requests", "/v1/admin")


def error_body(type_: str, message: str, request_id: str | None) -> dict[str, object]:
    """The shape of every error of the native API."""
    return {"error": {"type": type_, "message": message, "request_id": request_id}}


def openai_error_body(status: int, code: str, message: str) -> dict[str, object]:
    """The shape of every error of the OpenAI-compatible routes (what the official client parses)."""
    kind = OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@dataclass(frozen=True)
class ErrorShape:
    """How one API family writes an error: its body from (status, type, message, request id), and the type it
    gives an HTTP error raised by werkzeug."""

    body: Callable[[int, str, str, str | None], dict[str, object]]
    http_type: Callable[[int, HTTPException], str]

    def of(self, error: BatchingError, request_id: str | None) -> dict[str, object]:
        """The body of a domain error, its status from :data:`STATUSES`."""
        return self.body(status_of(error.type), error.type, error.message, request_id)


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
    """The one mapping of an exception to its answer: a BatchingError's status is its type's (:data:`STATUSES`),
    an HTTPException's its code, anything else is a logged 500."""
    if isinstance(exc, BatchingError):
        if exc.replay_of:  # an idempotent retry answered with the first call's error: under the first's id
            g.request_id, g.replayed = exc.replay_of, True
        return error_response(status_of(exc.type), exc.type, exc.message, exc.retry_after_s, shape)
    if isinstance(exc, HTTPException):
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 413:
            message = f"request body larger than {current_app.config['MAX_CONTENT_LENGTH']} bytes"
        allowed = sorted(exc.valid_methods or ()) if isinstance(exc, MethodNotAllowed) else None
        if allowed:  # a 405 says what the path takes, in its message and its Allow header
            message = f"{request.method} is not allowed on {request.path}; it takes {', '.join(allowed)}"
        elif isinstance(exc, HTTPNotFound) and request.url_rule is None:  # routing's, not a view's "no such batch"
            message = f"unrecognised request URL ({request.method} {request.path}): no route of this service has it"
        response = error_response(status, shape.http_type(status, exc), message, shape=shape)
        if allowed:
            response.headers["Allow"] = ", ".join(allowed)
        return response
    log.exception("unhandled error", extra={"request_id": g.get("request_id")})
    return error_response(500, "internal_error", "internal error; the request id is in the server log", shape=shape)


def shape_for(path: str) -> ErrorShape:
    """The error shape of the route family ``path`` belongs to, whether or not it matched a route."""
    if not path.startswith("/v1/") or any(path == route or path.startswith(route + "/") for route in NATIVE_ROUTES):
        return NATIVE
    return OPENAI


def _by_path(exc: Exception) -> Response:
    return exception_response(exc, shape_for(request.path))


def register_error_handlers(scope: Flask | Blueprint, shape: ErrorShape | None = None) -> None:
    """Answer ``scope``'s failures in ``shape`` (None: the shape of the family of the path called). Only the app
    catches every Exception, and routing's 404 and 405 (a blueprint's unexpected errors reach the app's handler)."""
    handler = _by_path if shape is None else partial(exception_response, shape=shape)
    scope.register_error_handler(BatchingError, handler)
    scope.register_error_handler(HTTPException, handler)
    if isinstance(scope, Flask):
        scope.register_error_handler(Exception, handler)
