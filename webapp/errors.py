"""Every failure becomes one JSON shape, ``{"error": {"type", "message", "request_id"}}``, mapped here once.

No HTML page and no stack trace ever reaches a caller: unexpected exceptions are logged and answered 500.
"""
from __future__ import annotations

import logging

from flask import Flask, Response, g, jsonify
from werkzeug.exceptions import HTTPException

from tasks.errors import BatchingError

log = logging.getLogger("llmb.web")

HTTP_TYPES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
              413: "payload_too_large", 415: "unsupported_media_type"}


OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 408: "timeout", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


def error_body(type_: str, message: str, request_id: str | None) -> dict[str, object]:
    """The shape of every error of the native API."""
    return {"error": {"type": type_, "message": message, "request_id": request_id}}


def openai_error_body(status: int, code: str, message: str) -> dict[str, object]:
    """The shape of every error of the OpenAI-compatible routes (what the official client parses)."""
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": None,
                      "code": code}}


def error_response(status: int, type_: str, message: str, retry_after_s: int | None = None) -> Response:
    g.error_type = type_
    response = jsonify(error_body(type_, message, g.get("request_id")))
    response.status_code = status
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(BatchingError)
    def _batching(exc: BatchingError) -> Response:
        return error_response(exc.status, exc.type, exc.message, exc.retry_after_s)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 413:
            message = f"request body larger than {app.config['MAX_CONTENT_LENGTH']} bytes"
        return error_response(status, HTTP_TYPES.get(status, "http_error"), message)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error", extra={"request_id": g.get("request_id")})
        return error_response(500, "internal_error", "internal error; the request id is in the server log")
