"""What a call is refused with, and why (pure): the gateway's rules, apart from the Redis and RabbitMQ they act on.

- :func:`deadline_refusal`: a call whose time could not cover one batch is refused before admission (504 when its
  timeout never could, 429 when the wait before its handler ran took it), from :func:`shortest_answer_s`;
- :func:`token_demand`: each item's estimated tokens and the model's token budget, refusing (400) an item that
  could never fit on any worker of the model;
- :func:`admission_refusal`: the error for each verdict of the admission script;
- :func:`error_of`: the caller-facing error for an item a worker or the batcher answered with one;
- :func:`not_served`: the 404 for a model no worker serves or lately served;
- :class:`FullVerdictCache`: a FULL verdict, held for a moment, refuses the model's next calls without asking Redis.

The gateway (:mod:`tasks.gateway`) feeds them the live workers and the call, and raises or returns the answer.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum

from tasks.errors import (
    BatchingError,
    ContextLengthExceeded,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    PoisonInput,
    QueueFull,
    RetriesExhausted,
    TenantOverLimit,
    Unavailable,
)
from tasks.policy import tokens
from tasks.policy.capacity import largest_fit, retry_after_s, token_budget
from tasks.schema import ItemResult, Priority, SamplingParams, WorkerInfo


class AdmissionVerdict(StrEnum):
    """What the admission script (:mod:`tasks.state.admission`) answers for a call."""

    OK = "ok"
    FULL = "full"
    TENANT_FULL = "tenant_full"
    QUARANTINED = "quarantined"
    LATE = "late"
    TOKENS_FULL = "tokens_full"

# After a FULL verdict for a model, this process refuses that model's calls of the same class for this long without
# asking Redis again: at 400 items/s a few items' worth of room, against a queue a few seconds deep.
FULL_HOLD_S = 0.02
FULL_MAX_HELD = 256  # verdicts held at most (models x classes): beyond it the expired go, then the oldest

# Error types a worker or the batcher writes into an item's result, and what the caller gets for each.
ERRORS: dict[str, type[BatchingError]] = {
    InvalidInput.type: InvalidInput,
    ContextLengthExceeded.type: ContextLengthExceeded,
    PoisonInput.type: PoisonInput,
    RetriesExhausted.type: RetriesExhausted,
    InferenceFailed.type: InferenceFailed,
}


def error_of(result: ItemResult) -> BatchingError:
    """The caller-facing error for an item that a worker or the batcher answered with one."""
    return ERRORS.get(result.error or "", InferenceFailed)(result.message or "the model failed on this input")


def not_served(model: str, served: Sequence[str]) -> ModelNotFound:
    """The refusal of a call naming a model that ``served`` (the models served now) does not hold."""
    return ModelNotFound(f"the model {model!r} is not served here (models served now: "
                         f"{', '.join(sorted(served)) or 'none'})")


def shortest_answer_s(workers: Sequence[WorkerInfo]) -> float:
    """The least time in which a new call could be answered: one batch on the fastest of the model's
    ``workers`` (0 while none is measured, or none is known: that refusal comes later)."""
    times = [w.batch_ms_estimate / 1000 for w in workers]
    return min((t for t in times if t > 0), default=0.0)


def deadline_refusal(model: str, timeout_ms: int, remaining_s: float, waited_s: float, shortest_s: float,
                     retry_floor_s: int) -> BatchingError | None:
    """The refusal of a call that could only be answered late (None: it has the time): its timeout shorter
    than one batch (``shortest_s``) takes is 504; the ``remaining_s`` after ``waited_s`` at this host shorter
    than that is 429."""
    if timeout_ms / 1000 < shortest_s:
        return DeadlineExceeded(f"a timeout of {timeout_ms} ms is shorter than one batch of {model!r} "
                                f"takes ({shortest_s * 1000:.0f} ms): it could never be met")
    if remaining_s < shortest_s:
        return Overloaded(f"this API process took {waited_s * 1000:.0f} ms to get "
                          f"to the request, leaving too little of its {timeout_ms} ms to answer it; retry "
                          "in a moment", retry_after_s=retry_floor_s)
    return None


def token_demand(inputs: Sequence[str], params: SamplingParams, model: str,
                 workers: Callable[[], Sequence[WorkerInfo] | None], kv_factor: float) -> tuple[list[int], int]:
    """Each item's estimated tokens (prompt + max_tokens; 0 for a non-generation item) and the model's token
    budget (0: none). ``workers`` gives the model's live workers (asked only for a generation call; None when
    they cannot be read, whose refusal comes later). Raises InvalidInput (400) for an item that could never fit
    on any worker of the model."""
    estimates = [tokens.estimated_tokens(text, params) for text in inputs]
    if all(e is None for e in estimates):
        return [], 0
    live = workers()
    if live is None:
        return [e or 0 for e in estimates], 0
    fit = largest_fit(live)
    budget = tokens.generation_budget(params) or 0
    for index, text in enumerate(inputs):
        least = tokens.least_prompt_tokens(text) + budget
        if fit and least > fit:
            raise InvalidInput(f"input {index} needs at least {least} tokens (its prompt and max_tokens "
                               f"{budget}), more than any worker of {model!r} holds for one request "
                               f"({fit}); shorten it or ask for fewer tokens")
    return [e or 0 for e in estimates], token_budget(live, kv_factor)


def admission_refusal(verdict: str, bad_hash: str | None, ahead: int, *, model: str, tenant: str,
                      tenant_cap: int | None, hashes: Sequence[str], workers: Sequence[WorkerInfo],
                      admission_cap: int, retry_floor_s: int) -> BatchingError | None:
    """The error a call is refused with for this admission verdict (None: admitted). ``hashes``: its inputs'
    (the quarantined one is named by index); ``ahead``: the items ahead in the set that was full, drained at
    the rate of the model's ``workers`` for the Retry-After (never below ``retry_floor_s``)."""
    if verdict == AdmissionVerdict.OK:
        return None
    if verdict == AdmissionVerdict.LATE:
        return Unavailable("Redis answered too late to admit the call (a slow or interrupted link); retry")
    if verdict == AdmissionVerdict.QUARANTINED:
        index = hashes.index(bad_hash or "")
        return PoisonInput(f"input {index} is quarantined (hash {bad_hash}): it failed alone before; an operator "
                           f"can release it with `llmb-admin quarantine release {bad_hash}`")
    served = [w for w in workers if w.model == model]
    if verdict == AdmissionVerdict.TENANT_FULL:
        cap = tenant_cap or admission_cap
        return TenantOverLimit(
            f"tenant {tenant!r} is at its cap of {cap} items in flight; retry when some are answered "
            "(other tenants are not affected)", retry_after_s=retry_after_s(ahead, served, floor_s=retry_floor_s))
    if verdict == AdmissionVerdict.TOKENS_FULL:
        return QueueFull(f"the KV memory of every worker serving {model!r} is spoken for ({ahead} tokens "
                         "admitted and unanswered); retry later", retry_after_s=retry_floor_s)
    return QueueFull("the service is full: no room to answer this request within its deadline; retry later",
                     retry_after_s=retry_after_s(ahead, served, floor_s=retry_floor_s))


class FullVerdictCache:
    """The last FULL verdict for each model and class of call, while it is fresh (``hold_s``): the calls of a
    flood are refused with it without waiting for a turn or asking Redis. At most ``max_held`` are kept: a verdict
    is worth nothing once ``hold_s`` has passed, so the expired go first, then the oldest."""

    def __init__(self, hold_s: float = FULL_HOLD_S, max_held: int = FULL_MAX_HELD) -> None:
        self.hold_s = hold_s
        self.max_held = max_held
        self.verdicts: dict[tuple[str, Priority], tuple[float, QueueFull]] = {}  # model, class -> (until, refusal)

    def hold(self, model: str, priority: Priority, error: QueueFull, now: float) -> None:
        self.verdicts.pop((model, priority), None)  # re-inserted last: the dict's order is the verdicts' age
        if len(self.verdicts) >= self.max_held:
            self.verdicts = {key: held for key, held in self.verdicts.items() if now < held[0]}
            while len(self.verdicts) >= self.max_held:
                del self.verdicts[next(iter(self.verdicts))]
        self.verdicts[model, priority] = (now + self.hold_s, error)

    def held(self, model: str, priority: Priority, now: float) -> QueueFull | None:
        """A fresh copy of the held refusal (None: none, or no longer fresh)."""
        held = self.verdicts.get((model, priority))
        if held is None or now >= held[0]:
            return None
        return QueueFull(held[1].message, retry_after_s=held[1].retry_after_s)

    def any_fresh(self, now: float) -> bool:
        return any(now < until for until, _ in self.verdicts.values())
