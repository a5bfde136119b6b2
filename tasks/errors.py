"""Named failures, every one of them here: each is a ``type`` and a message (and, for a refusal, when to retry), and
knows nothing of HTTP. The web layer maps each type to its status in one table (``webapp.errors.STATUSES``)."""
from __future__ import annotations


class BatchingError(Exception):
    """Base of every failure a caller can be told about."""

    type = "internal_error"
    replay_of: str | None = None  # set on an idempotent retry's answer: the request id of the call that gave it

    def __init__(self, message: str, *, retry_after_s: int | None = None, replay_of: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.replay_of = replay_of


class InvalidInput(BatchingError, ValueError):
    """Raised when a request body or one of its fields is malformed."""

    type = "invalid_request"


class ContextLengthExceeded(InvalidInput):
    """Raised when a prompt and its ``max_tokens`` cannot fit the model's context (OpenAI's code for it)."""

    type = "context_length_exceeded"


class Unauthorized(BatchingError):
    """Raised when a request carries no API key, or an unknown or revoked one."""

    type = "unauthorized"


class Forbidden(BatchingError):
    """Raised when a valid key asks for something it may not do (an admin route without an admin key)."""

    type = "forbidden"


class QuotaExceeded(BatchingError):
    """Raised when an upload would take its tenant over its file quota (count or bytes)."""

    type = "quota_exceeded"


class NotFound(BatchingError):
    """Raised when a file or batch is not the caller's tenant's (or does not exist)."""

    type = "not_found"


class ModelNotFound(BatchingError):
    """Raised when no live worker serves the model a call names (an OpenAI route's call, or a batch job's line:
    the line is tried again a few times first, a worker of its model may be starting)."""

    type = "model_not_found"


class AdapterConflict(BatchingError):
    """Raised when a LoRA adapter would be registered under a name already taken: another adapter's, or a model's
    that the fleet serves (a call's ``model`` must name one thing)."""

    type = "adapter_conflict"


class AdapterLimit(BatchingError):
    """Raised when registering a LoRA adapter would take the registry past ``LLMB_MAX_REGISTERED_ADAPTERS``."""

    type = "adapter_limit"


class IdempotencyConflict(BatchingError):
    """Raised when an Idempotency-Key is used again, by the same tenant, for a different request (another body,
    or another route) while it still names the first one."""

    type = "idempotency_conflict"


class IdempotencyInProgress(IdempotencyConflict):
    """Raised when a streamed call is retried with its Idempotency-Key while the first stream still runs (its
    client resumes it instead: ``GET /v1/requests/<id>/stream``)."""

    type = "idempotency_in_progress"


class NotResumable(BatchingError):
    """Raised when a call asked to be resumed as a stream cannot be: it was not streamed, or what the client
    lacks cannot be rebuilt (a completion's echoed prompt is not kept)."""

    type = "not_resumable"


class RecordUnreadable(BatchingError):
    """Raised when a call's record (asked for by ``GET /v1/requests/<id>``, or named by an Idempotency-Key) is
    in Redis but cannot be read: written by a newer version of the service, or damaged. The call is never run
    again on its key's account (it may have run), so this is a conflict with what is stored, not a failure to
    retry blindly: after a rolling upgrade a newer process reads it; otherwise a new key runs the call anew."""

    type = "record_unreadable"


class PayloadTooLarge(BatchingError):
    """Raised when a body exceeds the configured size limit."""

    type = "payload_too_large"


class PoisonInput(BatchingError):
    """Raised when an input failed alone (the model raised or its worker died on it) or is quarantined."""

    type = "poison_input"


class QueueFull(BatchingError):
    """Raised when admitting the request would exceed the admission cap."""

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

    type = "unavailable"


class RetriesExhausted(Unavailable):
    """Raised when a request's workers were lost more times than LLMB_MAX_RETRIES allows."""

    type = "retries_exhausted"


class DeadlineExceeded(BatchingError):
    """Raised when a request's deadline passes before its output arrives."""

    type = "deadline_exceeded"


class InferenceFailed(BatchingError):
    """Raised when the model raised on the batch that carried this request."""

    type = "inference_failed"


class StorageFull(BatchingError):
    """Raised when the files folder's disk (or the tenant's disk quota) is full while a file is written."""

    type = "insufficient_storage"


def _subclasses(cls: type[BatchingError]) -> list[type[BatchingError]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


# Every error by its type: the one name of a failure, kept in records and mapped to a status by the web layer.
TYPES: dict[str, type[BatchingError]] = {cls.type: cls for cls in _subclasses(BatchingError)}


def error_of_type(type_: str, message: str, *, replay_of: str | None = None) -> BatchingError:
    """The error of a type read back from a record (an idempotent retry answered as its first call was); a type
    this version does not know (written by a newer one) is an internal error with the same message."""
    return TYPES.get(type_, BatchingError)(message, replay_of=replay_of)
