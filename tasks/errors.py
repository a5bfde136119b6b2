"""Named failures. Each maps to one HTTP status in ``webapp.errors``, and nowhere else."""
from __future__ import annotations


class BatchingError(Exception):
    """Base of every failure a caller can be told about."""

    status = 500
    type = "internal_error"
    replay_of: str | None = None  # set on an idempotent retry's answer: the request id of the call that gave it

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidInput(BatchingError, ValueError):
    """Raised when a request body or one of its fields is malformed."""

    status = 400
    type = "invalid_request"


class ContextLengthExceeded(InvalidInput):
    """Raised when a prompt and its ``max_tokens`` cannot fit the model's context (OpenAI's code for it)."""

    type = "context_length_exceeded"


class Unauthorized(BatchingError):
    """Raised when a request carries no API key, or an unknown or revoked one."""

    status = 401
    type = "unauthorized"


class Forbidden(BatchingError):
    """Raised when a valid key asks for something it may not do (an admin route without an admin key)."""

    status = 403
    type = "forbidden"


class IdempotencyConflict(BatchingError):
    """Raised when an Idempotency-Key is used again, by the same tenant, for a different request (another body,
    or another route) while it still names the first one."""

    status = 409
    type = "idempotency_conflict"


class IdempotencyInProgress(IdempotencyConflict):
    """Raised when a streamed call is retried with its Idempotency-Key while the first stream still runs (its
    client resumes it instead: ``GET /v1/requests/<id>/stream``)."""

    type = "idempotency_in_progress"


class NotResumable(BatchingError):
    """Raised when a call asked to be resumed as a stream cannot be: it was not streamed, or what the client
    lacks cannot be rebuilt (a completion's echoed prompt is not kept)."""

    status = 409
    type = "not_resumable"


class RecordUnreadable(BatchingError):
    """Raised when a call's record (asked for by ``GET /v1/requests/<id>``, or named by an Idempotency-Key) is
    in Redis but cannot be read: written by a newer version of the service, or damaged. The call is never run
    again on its key's account (it may have run), so this is a conflict with what is stored, not a failure to
    retry blindly: after a rolling upgrade a newer process reads it; otherwise a new key runs the call anew."""

    status = 409
    type = "record_unreadable"


class PayloadTooLarge(BatchingError):
    """Raised when a body exceeds the configured size limit."""

    status = 413
    type = "payload_too_large"


class PoisonInput(BatchingError):
    """Raised when an input failed alone (the model raised or its worker died on it) or is quarantined."""

    status = 422
    type = "poison_input"


class QueueFull(BatchingError):
    """Raised when admitting the request would exceed the admission cap."""

    status = 429
    type = "queue_full"


class TenantOverLimit(QueueFull):
    """Raised when admitting the request would take its tenant over the tenant's own in-flight cap."""

    type = "tenant_over_limit"


class Overloaded(QueueFull):
    """Raised when this API process is too busy to take the request now (its Redis or broker connections
    stayed taken for seconds): refused rather than left to time out; retry shortly, or on another host."""

    type = "overloaded"


class Unavailable(BatchingError):
    """Raised when RabbitMQ or Redis cannot be reached, or no GPU worker is alive."""

    status = 503
    type = "unavailable"


class RetriesExhausted(Unavailable):
    """Raised when a request's workers were lost more times than LLMB_MAX_RETRIES allows."""

    type = "retries_exhausted"


class DeadlineExceeded(BatchingError):
    """Raised when a request's deadline passes before its output arrives."""

    status = 504
    type = "deadline_exceeded"


class InferenceFailed(BatchingError):
    """Raised when the model raised on the batch that carried this request."""

    status = 500
    type = "inference_failed"
