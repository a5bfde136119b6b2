"""The API side of the pipeline, free of HTTP: admit a call, publish it, wait for its outputs.

The web app is a thin shell over :meth:`Gateway.submit`; anything else that submits work (the admin CLI's
replay, a benchmark) can use the same path.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import redis
from amqp.exceptions import AMQPError
from kombu.exceptions import KombuError

from tasks.broker.gate import NO_GATE, Gate, Turn
from tasks.broker.queues import PublisherBusy, PublishTimeout, RequestPublisher
from tasks.broker.rounds import Rounds
from tasks.config import Settings
from tasks.errors import (
    BatchingError,
    DeadlineExceeded,
    IdempotencyConflict,
    IdempotencyInProgress,
    InferenceFailed,
    InvalidInput,
    Overloaded,
    PoisonInput,
    QueueFull,
    RetriesExhausted,
    TenantOverLimit,
    Unavailable,
)
from tasks.policy import tokens
from tasks.policy.capacity import deadline_cap, largest_fit, retry_after_s, token_budget
from tasks.schema import InferenceRequest, Item, ItemResult, Priority, WorkerInfo, input_hash
from tasks.state import connect
from tasks.state.admission import Admission, AdmitCall, CollectCall, Decision, Ticket, Verdict
from tasks.state.clock import SharedClock
from tasks.state.connect import PoolExhausted
from tasks.state.fleet import Fleet, FleetCache
from tasks.state.keys import Keys
from tasks.state.metrics import door_round_calls
from tasks.state.requests import Claim, Idempotency, Outcome, Record, Requests, Shape, State, View
from tasks.state.results import ResultListener

log = logging.getLogger(__name__)
T = TypeVar("T")

BROKER_ERRORS = (KombuError, AMQPError, OSError)
REDIS_TIMEOUT_S = 5.0  # an API process's Redis commands: longest wait for an answer
FOLLOW_CHECK_S = 0.2  # an idempotent retry waiting on the first call looks at its record this often
OUTCOME_POLL_S = 0.05  # ... and this often once the results are in, until the live first call records its answer
# An admission reaching Redis later than this after it was sent is refused by the script itself: its caller
# may have had a timeout by then (503), and admitting it would hold capacity nobody releases.
ADMIT_VALID_S = REDIS_TIMEOUT_S / 2


def redis_client(settings: Settings) -> redis.Redis:
    """The Redis client of an API process: one bounded pool shared by all of its waiting callers (a plain Redis
    or the master behind Sentinel, as ``LLMB_REDIS_URL`` says); a caller that waits 5 s for a connection gets
    :class:`PoolExhausted`."""
    return connect.redis_client(settings, max_connections=settings.redis_pool_size, pool_timeout_s=5,
                                socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=2)


ROUND_MAX_CALLS = 64  # calls admitted in one script call and published in one message, at most

# After a FULL verdict for a model, this process refuses that model's calls of the same class for this long without
# asking Redis again: at 400 items/s a few items' worth of room, against a queue a few seconds deep.
FULL_HOLD_S = 0.02


def _overloaded(exc: Exception) -> Overloaded:
    return Overloaded(f"this API process is overloaded ({exc}); retry in a moment",
                      retry_after_s=1)

# Error types a worker or the batcher writes into an item's result, and what the caller gets for each.
_ERRORS: dict[str, type[BatchingError]] = {
    InvalidInput.type: InvalidInput,
    PoisonInput.type: PoisonInput,
    RetriesExhausted.type: RetriesExhausted,
    InferenceFailed.type: InferenceFailed,
}


def error_of(result: ItemResult) -> BatchingError:
    """The caller-facing error for an item that a worker or the batcher answered with one."""
    return _ERRORS.get(result.error or "", InferenceFailed)(result.message or "the model failed on this input")


def _replayed_error(record: Record, outcome: Outcome) -> BatchingError:
    """The error a recorded call was answered with, again (same status, type and message; the first's id)."""
    error = BatchingError(outcome.message)
    error.status, error.type, error.replay_of = outcome.status, outcome.type, record.request_id
    return error


def _replayed(result: ItemResult) -> Generator[tuple[str, Any], None, None]:
    """A finished stream's events, for an idempotent retry: its whole result at once."""
    yield "done", result


@dataclass(frozen=True)
class Call:
    """One validated API call."""

    request_id: str
    tenant: str
    model: str
    inputs: tuple[str, ...]
    timeout_ms: int
    params: dict[str, Any] = field(default_factory=dict)  # model parameters, passed to the worker as they are
    weight: float = 1.0  # the tenant's share of batch slots when tenants compete
    priority: Priority = Priority.INTERACTIVE
    tenant_cap: int | None = None  # the tenant's in-flight cap (None: only the global caps)
    received_at: float | None = None  # when it reached this host (monotonic): its deadline counts from then


@dataclass(frozen=True)
class Answer:
    """Every item's result, in input order, with when the call was accepted."""

    results: tuple[ItemResult, ...]
    accepted_at: float
    request_id: str = ""  # the call that ran: this one, or the first one for an idempotent retry (``replayed``)
    total_ms: float | None = None  # arrival to answer, as the server saw it
    replayed: bool = False


@dataclass(frozen=True)
class Lookup:
    """A call as ``GET /v1/requests/<id>`` shows it: running, or finished with its answer or its error."""

    record: Record
    state: State
    present: int  # items with a result
    answer: Answer | None = None
    error: BatchingError | None = None


class Events:
    """A streamed call's events (see :meth:`Gateway.stream`): iterate them; closing early cancels the generation.
    ``request_id`` is the call's (the first call's, for a replayed idempotent retry)."""

    def __init__(self, request_id: str, events: Generator[tuple[str, Any], None, None], replayed: bool = False) -> None:
        self.request_id = request_id
        self.replayed = replayed
        self._events = events

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self._events

    def close(self) -> None:
        self._events.close()


@dataclass(frozen=True)
class _Prepared:
    """A call checked and ready to be admitted: its request, its record, its time and its tokens."""

    request: InferenceRequest
    record: Record
    remaining_s: float
    deadline: float  # monotonic
    item_tokens: list[int]
    token_cap: int


@dataclass(frozen=True)
class _Joining:
    """A prepared call in a round at the door: what its admission needs, and its turn at the gate."""

    call: Call
    prepared: _Prepared
    admit: AdmitCall
    turn: Turn


@dataclass(frozen=True)
class _Entered:
    """A call admitted and published by this process."""

    ids: list[str]
    deadline: float  # monotonic
    accepted_at: float
    record: Record
    idempotency: Idempotency | None
    waiter: Any  # the result listener's, registered before the request was published


class Gateway:
    def __init__(self, settings: Settings, client: redis.Redis, publisher: RequestPublisher, instance_id: str,
                 gate: Gate | None = None) -> None:
        self.settings = settings
        self.gate = gate  # an API process's turnstile in front of admission (none: every call goes at once)
        self._full: dict[tuple[str, Priority], tuple[float, QueueFull]] = {}  # model, class -> (until, refusal)
        self.client = client
        self.publisher = publisher
        self.keys = Keys.from_settings(settings)
        self.reply_to = self.keys.replies(instance_id)
        self.instance_id = instance_id
        self.admission = Admission.from_settings(settings, client, instance_id)
        self.requests = Requests.from_settings(settings, client)
        self._lease_started = False
        # Times other hosts compare with (deadlines sent to batchers and workers, heartbeats read) are on the
        # fleet's shared clock; this process's own waits run on its monotonic clock.
        self.clock = SharedClock.from_settings(settings, client)
        self.fleet = Fleet.from_settings(settings, client)
        # A stopping worker still serves its model: a rolling restart must not flap it to 503.
        self.workers = FleetCache(self.fleet, settings.heartbeat_interval_s / 2, draining=True, wallclock=self.clock)
        self.result_key = self.keys.result
        self.listener = ResultListener(client, self.reply_to, self.result_key, settings.result_recheck_ms / 1000)
        # The calls (and the result reads) this process has ready at once go to Redis and RabbitMQ together.
        self.rounds: Rounds[_Joining, Any] = Rounds(self._admit_round, ROUND_MAX_CALLS, lambda: Unavailable(
            "the call's admission round was interrupted; retry"))
        self.reads: Rounds[CollectCall, tuple[list[bytes | None], bool]] = Rounds(
            lambda calls, hand_on: self.admission.collect_many(calls), ROUND_MAX_CALLS,
            lambda: redis.ConnectionError("the round reading the results was interrupted"))

    def live_workers(self, fresh: bool = False) -> list[WorkerInfo]:
        """The live fleet; cached for half a heartbeat interval (``fresh``: read it now)."""
        try:
            return self.workers.get(fresh)
        except PoolExhausted as exc:
            raise _overloaded(exc) from None
        except redis.RedisError as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None

    def live_models(self, fresh: bool = False) -> set[str]:
        return {w.model for w in self.live_workers(fresh)}

    def cap_for(self, model: str, timeout_s: float) -> int:
        """Items of ``model`` that may be in flight for a new one to be answered within ``timeout_s``."""
        workers = [w for w in self.live_workers() if w.model == model]
        return deadline_cap(workers, timeout_s, self.settings.admission_cap)

    def _retry_after(self, model: str, ahead: int) -> int:
        """When to come back: the items ahead, drained at the model's measured rate (never below the floor)."""
        workers = [w for w in self.workers.last if w.model == model]
        return retry_after_s(ahead, workers, floor_s=self.settings.retry_after_s)

    def _reader(self, ticket: Ticket) -> Callable[[Sequence[str]], list[bytes | None]]:
        """Reads a call's results and releases the admission of those that have one, in one round trip (shared
        with the other callers reading at the same moment: :attr:`reads`)."""
        return lambda ids: self.reads.join(CollectCall(ticket, tuple(ids), tuple(self.result_key(i) for i in ids)))[0]

    def _finishing_reader(self, ticket: Ticket, entered: _Entered, started: float,
                          finished: list[float]) -> Callable[[Sequence[str]], list[bytes | None]]:
        """:meth:`_reader`, which also records a successful outcome when one read finds every result (a call
        without an idempotency key: its outcome is then written in the same round trip); ``finished`` gets the
        call's total_ms when it did."""
        every = len(entered.ids)

        def read(ids: Sequence[str]) -> list[bytes | None]:
            keys = tuple(self.result_key(i) for i in ids)
            if len(ids) < every:
                return self.reads.join(CollectCall(ticket, tuple(ids), keys))[0]
            total_ms = round((time.monotonic() - started) * 1000, 1)
            record = self.requests.finished(entered.record, Outcome(200, total_ms=total_ms))
            values, done = self.reads.join(CollectCall(ticket, tuple(ids), keys, record))
            if done:
                finished.append(total_ms)
            return values

        return read

    def submit(self, call: Call, *, shape: Shape | None = None, idempotency: Idempotency | None = None) -> Answer:
        """Run one call through the pipeline. Raises a :class:`tasks.errors.BatchingError` on any failure.

        Every admitted call is recorded (its items, ``shape``, outcome) for ``GET /v1/requests/<id>``. With
        ``idempotency``, a call whose key already names an earlier call of the tenant is not run: it waits for
        that call (within its own deadline) and gets its answer, or IdempotencyConflict if the body differs."""
        entered = self._enter(call, shape or Shape(), idempotency, follow=True)
        if isinstance(entered, Answer):
            return entered
        ids, deadline = entered.ids, entered.deadline
        ticket = Ticket(call.tenant, call.model, call.priority)
        started = call.received_at or entered.deadline - call.timeout_ms / 1000
        found: dict[str, ItemResult] = {}
        finished: list[float] = []  # total_ms, once the read that found every result also recorded the outcome
        try:
            found = self.listener.wait(ids, deadline, self._finishing_reader(ticket, entered, started, finished)
                                       if idempotency is None else self._reader(ticket), waiter=entered.waiter)
        except redis.RedisError as exc:
            raise Unavailable(f"Redis is unreachable while waiting for the result: {exc}") from None
        finally:  # items with a result were released as they were read: release the rest
            self._release(ticket, [i for i in ids if i not in found])
        if finished and len(found) == len(ids):
            return Answer(results=tuple(found[i] for i in ids), accepted_at=entered.accepted_at,
                          request_id=call.request_id, total_ms=finished[0])
        total_ms = round((time.monotonic() - started) * 1000, 1)
        if len(found) < len(ids):
            error: BatchingError = DeadlineExceeded(f"no output within {call.timeout_ms} ms (deadline passed)")
            self._settle(entered, error)  # before the cancel: a retry must never take a cancelled output for it
            self.cancel([i for i in ids if i not in found])
            raise error
        results = tuple(found[i] for i in ids)
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            error = error_of(failed)
            self._settle(entered, error, results=results)
            raise error
        self._settle(entered, None, total_ms, results)
        return Answer(results=results, accepted_at=entered.accepted_at, request_id=call.request_id, total_ms=total_ms)

    def stream(self, call: Call, *, shape: Shape | None = None, idempotency: Idempotency | None = None) -> Events:
        """Admit and publish a one-input call now (so refusals raise here), then return its events:
        ("delta", text) as the worker streams, then ("done", ItemResult) or ("error", BatchingError).
        Closing the iterator early (the client went away) cancels the generation in the worker, and forgets the
        call (a retry with its idempotency key runs it again).

        An idempotent retry of a finished stream gets the first call's result as one ("done", ItemResult); of a
        stream still running, IdempotencyInProgress (409): its text went to the first caller."""
        if len(call.inputs) != 1:
            raise InvalidInput("streaming takes exactly one prompt")
        call = replace(call, params={**call.params, "stream": True})
        entered = self._enter(call, replace(shape or Shape(), stream=True), idempotency, follow=False)
        if isinstance(entered, Answer):
            return Events(entered.request_id, _replayed(entered.results[0]), replayed=True)
        return Events(call.request_id, self._events(Ticket(call.tenant, call.model, call.priority), entered))

    def _events(self, ticket: Ticket, entered: _Entered) -> Generator[tuple[str, Any], None, None]:
        item_id, finished, settled = entered.ids[0], False, False
        try:
            for kind, value in self.listener.stream(item_id, entered.deadline, self._reader(ticket),
                                                    waiter=entered.waiter):
                if kind == "delta":
                    yield kind, value
                elif kind == "done":
                    finished = True
                    error = error_of(value) if value.error else None
                    settled = self._settle(entered, error, results=(value,))
                    yield ("error", error) if error else ("done", value)
                else:
                    error = DeadlineExceeded("no complete output before the deadline")
                    settled = self._settle(entered, error)
                    yield "error", error
        except redis.RedisError as exc:
            settled = True  # nothing can be recorded now; the record keeps what it had
            yield "error", Unavailable(f"Redis is unreachable while streaming: {exc}")
        finally:
            if not settled:  # the client went away mid-stream: forget the call before its generation stops
                self._forget(entered.record, entered.idempotency)
            if not finished:
                self.cancel([item_id])
                self._release(ticket, [item_id])

    # -- calls by id, idempotency ---------------------------------------------------------------------
    def lookup(self, tenant: str, request_id: str) -> Lookup | None:
        """The tenant's call of this id (None: unknown to this tenant, or expired)."""
        view = self.redis_call(partial(self.requests.look, tenant, request_id))
        return None if view is None else self.redis_call(partial(self._outcome_of, view))

    def _outcome_of(self, view: View) -> Lookup | None:
        """What a recorded call came to, from its record and its results (None: its results expired)."""
        record = view.record
        outcome = record.outcome
        running = Lookup(record, State.RUNNING, view.present)
        if outcome is not None and outcome.status != 200:
            return Lookup(record, State.FAILED, view.present, error=_replayed_error(record, outcome))
        if view.expired:
            error = DeadlineExceeded(f"no output before the deadline of request {record.request_id!r}")
            error.replay_of = record.request_id
            return Lookup(record, State.FAILED, view.present, error=error)
        if outcome is None and not view.results_decide:
            return running
        found = self.requests.results(record)
        results = tuple(r for r in found if r is not None)
        if len(results) < len(found):
            return None
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            item_error = error_of(failed)
            item_error.replay_of = record.request_id
            return Lookup(record, State.FAILED, view.present, error=item_error)
        # no outcome (its API process died): answered when the last item finished on its worker
        total_ms = outcome.total_ms if outcome is not None else round(
            max((r.started_at + r.run_ms / 1000 - record.accepted_at) * 1000 for r in results), 1)
        return Lookup(record, State.COMPLETED, view.present,
                      answer=Answer(results, record.accepted_at, record.request_id, total_ms, replayed=True))

    def _follow(self, call: Call, idempotency: Idempotency, claim: Claim, deadline: float,
                follow: bool) -> Answer | None:
        """An idempotent retry: the first call's answer (or its error, raised), waiting for it within this call's
        deadline while it runs (``follow``; else IdempotencyInProgress); None when the first call is forgotten
        meanwhile (refused before it ran: this one should run)."""
        while True:
            view = claim.view
            if view is None:
                return None
            if not claim.same_body:
                raise IdempotencyConflict(
                    f"this Idempotency-Key was used for a different request (request {view.record.request_id!r}, "
                    "another body or route); use a new key for a new request")
            found = self.redis_call(partial(self._outcome_of, view))
            if found is None:  # its record outlived its results: nothing to answer with; run it again
                self._forget(view.record, idempotency)
                return None
            if found.state is not State.RUNNING:
                if found.error is not None:
                    raise found.error
                assert found.answer is not None
                return found.answer
            if not follow:
                raise IdempotencyInProgress(
                    f"the stream of request {view.record.request_id!r} with this Idempotency-Key is still running; "
                    "retry once it has finished to get its result")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"no output within {call.timeout_ms} ms: request "
                                       f"{view.record.request_id!r} with this Idempotency-Key is still running")
            if view.present == len(view.record.items):  # the answer is in; the first call is recording it
                time.sleep(min(OUTCOME_POLL_S, remaining))
            else:  # woken with the first call's own waiter when it runs in this process
                items, until = view.record.items, min(deadline, time.monotonic() + FOLLOW_CHECK_S)
                self.redis_call(partial(self.listener.wait, items, until))
            claim = self.redis_call(partial(self.requests.peek, call.tenant, idempotency))

    def redis_call(self, command: Callable[[], T]) -> T:
        """A Redis command of the request path: 429 when this process's pool stays taken, 503 when Redis is away.
        Routes that read Redis through the gateway's objects (the admin API) go through it too: one translation."""
        try:
            return command()
        except PoolExhausted as exc:
            raise _overloaded(exc) from None
        except redis.RedisError as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None

    def _settle(self, entered: _Entered, error: BatchingError | None, total_ms: float = 0.0,
                results: Sequence[ItemResult] = ()) -> bool:
        """Record how an admitted call ended (best effort: without Redis its results are the record); with its
        ``results``, the record expires with the first of them."""
        outcome = Outcome(200, total_ms=total_ms) if error is None else Outcome(error.status, error.type,
                                                                                error.message)
        written_at = min((r.started_at + r.run_ms / 1000 for r in results), default=None)
        try:
            self.requests.finish(entered.record, outcome, entered.idempotency, self.clock(), written_at)
        except redis.RedisError as exc:
            log.warning("could not record the outcome of request %s: %s", entered.record.request_id, exc)
        return True

    def _mark_published(self, calls: Sequence[_Joining]) -> None:
        """Mark the records of the idempotent calls (those whose claim wrote the record) published, in the round
        that published them: a process killed between the confirm and the mark can run such a call twice, and
        that window is one round trip long, not every caller's wake-up."""
        records = [c.prepared.record for c in calls if c.admit.record is None]
        if not records:
            return
        try:
            self.requests.published(records)
        except redis.RedisError as exc:  # a retry after this process died would wait for the deadline
            log.warning("could not mark %d requests published: %s", len(records), exc)

    def _forget(self, record: Record, idempotency: Idempotency | None) -> None:
        try:
            self.requests.release(record, idempotency)
        except redis.RedisError as exc:  # the key expires with its TTL
            log.warning("could not forget request %s: %s", record.request_id, exc)

    def cancel(self, item_ids: list[str]) -> None:
        """Tell the workers these callers are gone, so generation for them stops (best effort)."""
        try:
            self.client.publish(self.keys.cancel, ",".join(item_ids))
        except redis.RedisError:
            pass

    def _enter(self, call: Call, shape: Shape, idempotency: Idempotency | None, *, follow: bool) -> _Entered | Answer:
        """Admit and publish a call (recording it); or, for an idempotent retry, the first call's answer.

        The deadline counts from when the call reached this host: under a burst, time spent waiting for the
        CPU before the handler ran is the caller's time too. A call whose remaining time could not cover one
        batch is refused now (it would only be answered late): 504 if its timeout never could, 429 if the
        wait at the door took it.

        With ``idempotency`` the key is claimed (one Lua call) just before admission; when it names an earlier
        call, that call is followed instead (:meth:`_follow`). Any refusal before the request is published
        releases the key."""
        while True:
            if idempotency is None:  # a retry may be answered from its first call: it needs no room
                self._still_full(call)
            with self._turn(call.tenant) as turn:
                prepared = self._prepare(call, shape)
                claim = None
                if idempotency is not None:
                    self._keep_lease()  # the lease tells whoever follows this call that its process is alive
                    # its record lives under its key from now on (every later write finds it there), not its id
                    prepared = replace(prepared, record=replace(prepared.record, key_hash=idempotency.key_hash))
                    claim = self.redis_call(partial(self.requests.claim, replace(prepared.record, published=False),
                                                    idempotency, self.clock()))
                if idempotency is None or claim is None or claim.claimed:
                    return self._admitted(call, prepared, idempotency, turn)
            answer = self._follow(call, idempotency, claim, prepared.deadline, follow)  # its turn given up
            if answer is not None:
                return answer

    def _still_full(self, call: Call) -> None:
        """Raise the QueueFull of the model's last FULL verdict while it is fresh (FULL_HOLD_S): the calls of a
        flood are then refused without waiting for a turn or asking Redis, in the time a batch drains a few items."""
        held = self.held_full(call.model, call.priority)
        if held is not None and not self._light(call.tenant):
            raise held

    def held_full(self, model: str, priority: Priority) -> QueueFull | None:
        """The refusal a call of ``model`` in class ``priority`` gets now without asking Redis (None: ask): the
        last FULL verdict for them, while it is fresh. Idempotent retries are not held (see :meth:`_enter`)."""
        held = self._full.get((model, priority))
        if held is None or time.monotonic() >= held[0]:
            return None
        return QueueFull(held[1].message, retry_after_s=held[1].retry_after_s)

    def holds_full(self) -> bool:
        """Whether any FULL verdict is fresh: the door looks for one at accept only then."""
        now = time.monotonic()
        return any(now < until for until, _ in self._full.values())

    def _light(self, tenant: str) -> bool:
        """Whether ``tenant`` sends well under an even share of this process's recent calls (its gate's count)."""
        return self.gate is not None and self.gate.callers.light(tenant)

    def _model_cap(self, call: Call, remaining_s: float) -> int:
        """The model's cap for a call: the deadline cap (what the fleet can answer within ``remaining_s``), or for
        a light tenant the configured cap. The batchers serve tenants fairly, so a light tenant's items run
        ahead of a flood's queue, and refusing them because the flood filled the model was what the steady
        tenant beside a 5,000-call flood saw (10-54 of its 200 calls 429 queue_full); a light tenant is by
        definition a small share of the calls, so letting it past adds little."""
        if self._light(call.tenant):
            return self.settings.admission_cap
        return self.cap_for(call.model, remaining_s)

    def _turn(self, tenant: str) -> AbstractContextManager[Turn]:
        """A call's turn through admission (at once when the process has no gate, or for a light tenant)."""
        return nullcontext(NO_GATE) if self.gate is None else self.gate.passage(tenant)

    def _admitted(self, call: Call, prepared: _Prepared, idempotency: Idempotency | None, turn: Turn) -> _Entered:
        try:
            waiter = self._admit(call, prepared, turn, recorded=idempotency is not None)
        except BaseException:
            if idempotency is not None:
                self._forget(prepared.record, idempotency)
            raise
        return _Entered([i.id for i in prepared.request.items], prepared.deadline, prepared.request.accepted_at,
                        prepared.record, idempotency, waiter)

    def _prepare(self, call: Call, shape: Shape) -> _Prepared:
        """The checks before admission, and the request (and its record) a call would be admitted as."""
        now = time.monotonic()
        deadline = (call.received_at or now) + call.timeout_ms / 1000
        remaining_s = deadline - now
        shortest_s = self._shortest_answer_s(call.model)
        if call.timeout_ms / 1000 < shortest_s:
            raise DeadlineExceeded(f"a timeout of {call.timeout_ms} ms is shorter than one batch of {call.model!r} "
                                   f"takes ({shortest_s * 1000:.0f} ms): it could never be met")
        if remaining_s < shortest_s:
            raise Overloaded(f"this API process took {(now - (call.received_at or now)) * 1000:.0f} ms to get "
                             f"to the request, leaving too little of its {call.timeout_ms} ms to answer it; retry "
                             "in a moment", retry_after_s=self.settings.retry_after_s)
        accepted_at = self.clock()
        items = tuple(Item(id=uuid.uuid4().hex, input=text) for text in call.inputs)
        request = InferenceRequest(
            id=call.request_id, tenant=call.tenant, model=call.model, items=items,
            accepted_at=accepted_at, deadline=accepted_at + remaining_s, reply_to=self.reply_to,
            params=call.params, weight=call.weight, priority=call.priority,
        )
        record = Record(request_id=call.request_id, tenant=call.tenant, model=call.model,
                        items=tuple(i.id for i in items), accepted_at=accepted_at, deadline=request.deadline,
                        instance=self.instance_id, shape=shape)
        item_tokens, token_cap = self._token_demand(call)
        return _Prepared(request, record, remaining_s, deadline, item_tokens, token_cap)

    def _admit(self, call: Call, prepared: _Prepared, turn: Turn, *, recorded: bool) -> Any:
        """Admit a prepared call, record it (unless its idempotency claim did) and publish it, in a round with the
        other calls this process has ready (:mod:`tasks.broker.rounds`); its ``turn`` at the gate is given up
        once only the broker's confirm is left to wait for. Returns the result listener's waiter."""
        # the record must exist before any result does: written with the admission (unless its claim wrote it)
        record = None if recorded else self.requests.admitted(prepared.record, self.clock())
        request = prepared.request
        admit = AdmitCall(tuple(i.id for i in request.items), tuple(input_hash(call.model, t) for t in call.inputs),
                          Ticket(call.tenant, call.model, call.priority), request.accepted_at, prepared.remaining_s,
                          self._model_cap(call, prepared.remaining_s), call.tenant_cap,
                          tuple(prepared.item_tokens), prepared.token_cap, record)
        joining = _Joining(call, prepared, admit, turn)
        if recorded:  # an idempotent call goes alone: a process killed between a round's confirm and its mark
            outcome = self._admit_round([joining], lambda: None)[0]  # would leave the whole round to run twice
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return self.rounds.join(joining)

    def _admit_round(self, calls: Sequence[_Joining], hand_on: Callable[[], None]) -> list[Any]:
        """One round: admit the calls in one script call, publish those admitted in one message. A listener's
        waiter per call admitted and published, the error it is refused with for the others. The next round
        may start (``hand_on``) while this one waits for the broker's confirm: under a broker alarm that wait is
        the whole publish timeout, and each round must get its 503 within it, not after the rounds before it."""
        door_round_calls().observe(len(calls))
        try:
            self._keep_lease()
            decisions = self.admission.try_admit_many([c.admit for c in calls], self.clock() + ADMIT_VALID_S)
        except PoolExhausted as exc:
            return [_overloaded(exc) for _ in calls]
        except redis.RedisError as exc:
            return [Unavailable(f"Redis is unreachable: {exc}") for _ in calls]
        outcomes: list[Any] = [self._refusal(c, d) for c, d in zip(calls, decisions)]
        admitted = [i for i, outcome in enumerate(outcomes) if outcome is None]
        waiters: dict[int, Any] = {}  # the result listener's, once registered
        try:  # after admission, so that a quarantined input is refused as such even while no worker is up
            for i in admitted:
                error = self._unserved(calls[i].call.model)
                if error is not None:
                    outcomes[i] = error
                    self._unadmit(calls[i])
            published = [i for i in admitted if outcomes[i] is None]
            if not published:
                return outcomes
            # listening before publishing: a result or streamed text can come back before publish() returns
            for i in published:
                waiters[i] = self.listener.expect(list(calls[i].admit.item_ids))
                calls[i].turn.leave()
            hand_on()
            error = self._publish([calls[i].prepared for i in published])
            if error is None:
                self._mark_published([calls[i] for i in published])
            for i in published:
                if error is None:
                    outcomes[i] = waiters.pop(i)
                else:
                    outcomes[i] = error
                    self._unadmit(calls[i], waiters.pop(i))
            return outcomes
        except BaseException:
            for i in admitted:
                if outcomes[i] is None:
                    self._unadmit(calls[i], waiters.get(i))
            raise

    def _refusal(self, joining: _Joining, decision: Decision) -> BatchingError | None:
        """The error a call is refused with for this admission verdict (None: admitted)."""
        call, (verdict, bad_hash, ahead) = joining.call, decision
        if verdict is Verdict.OK:
            return None
        if verdict is Verdict.LATE:
            return Unavailable("Redis answered too late to admit the call (a slow or interrupted link); retry")
        if verdict is Verdict.QUARANTINED:
            index = joining.admit.hashes.index(bad_hash or "")
            return PoisonInput(f"input {index} is quarantined (hash {bad_hash}): it failed alone before; an operator "
                               f"can release it with `llmb-admin quarantine release {bad_hash}`")
        if verdict is Verdict.TENANT_FULL:
            cap = call.tenant_cap or self.settings.admission_cap
            return TenantOverLimit(
                f"tenant {call.tenant!r} is at its cap of {cap} items in flight; retry when some are answered "
                "(other tenants are not affected)", retry_after_s=self._retry_after(call.model, ahead))
        if verdict is Verdict.TOKENS_FULL:
            return QueueFull(f"the KV memory of every worker serving {call.model!r} is spoken for ({ahead} tokens "
                             "admitted and unanswered); retry later", retry_after_s=self.settings.retry_after_s)
        error = QueueFull("the service is full: no room to answer this request within its deadline; retry later",
                          retry_after_s=self._retry_after(call.model, ahead))
        self._full[call.model, call.priority] = (time.monotonic() + FULL_HOLD_S, error)
        return error

    def _unserved(self, model: str) -> BatchingError | None:
        """Unavailable when no live worker serves ``model`` (the cached view is checked again fresh first: it
        may predate a worker)."""
        try:
            models = self.live_models()
            if model not in models:
                models = self.live_models(fresh=True)
        except BatchingError as exc:
            return exc
        if model in models:
            return None
        served = ", ".join(sorted(models)) or "none"
        return Unavailable(f"no live GPU worker serves model {model!r} (models served now: {served})")

    def _publish(self, calls: Sequence[_Prepared]) -> BatchingError | None:
        """Publish the requests of a round as one message; the error its callers get when that fails."""
        budget = min(self.settings.publish_timeout_s, max(0.0, max(c.deadline for c in calls) - time.monotonic()))
        try:
            self.publisher.publish([c.request for c in calls], budget)
        except PublishTimeout as exc:
            return Unavailable(f"{exc} (is it blocked by a memory or disk alarm?); retry later")
        except PublisherBusy as exc:
            return _overloaded(exc)
        except BROKER_ERRORS as exc:
            return Unavailable(f"RabbitMQ is unreachable: {exc}")
        return None

    def _unadmit(self, joining: _Joining, waiter: Any = None) -> None:
        """Undo the admission of a call that will not be published: its items, the record the admission wrote,
        its listener's waiter."""
        ids = list(joining.admit.item_ids)
        self._release(joining.admit.ticket, ids)
        if joining.admit.record is not None:
            self._forget(joining.prepared.record, None)
        if waiter is not None:
            self.listener.forget(ids, waiter)

    def _token_demand(self, call: Call) -> tuple[list[int], int]:
        """Each item's estimated tokens (prompt + max_tokens; 0 for a non-generation item) and the model's token
        budget (0: none). An item that could never fit on any worker of the model is refused here (400)."""
        estimates = [tokens.estimated_tokens(text, call.params) for text in call.inputs]
        if all(e is None for e in estimates):
            return [], 0
        try:
            workers = [w for w in self.live_workers() if w.model == call.model]
        except BatchingError:
            return [e or 0 for e in estimates], 0  # the refusal for want of Redis or a worker comes later
        fit = largest_fit(workers)
        budget = tokens.generation_budget(call.params) or 0
        for index, text in enumerate(call.inputs):
            least = tokens.least_prompt_tokens(text) + budget
            if fit and least > fit:
                raise InvalidInput(f"input {index} needs at least {least} tokens (its prompt and max_tokens "
                                   f"{budget}), more than any worker of {call.model!r} holds for one request "
                                   f"({fit}); shorten it or ask for fewer tokens")
        return [e or 0 for e in estimates], token_budget(workers, self.settings.kv_admission_factor)

    def _shortest_answer_s(self, model: str) -> float:
        """The least time in which a new call could be answered: one batch on the model's fastest worker
        (0 while nothing is measured, or when the model is not served: that refusal comes later)."""
        try:
            times = [w.batch_ms_estimate / 1000 for w in self.live_workers() if w.model == model]
        except BatchingError:
            return 0.0
        return min((t for t in times if t > 0), default=0.0)

    def _keep_lease(self) -> None:
        """Start renewing this process's admission lease (once, lazily: after gunicorn forked it)."""
        if self._lease_started:
            return
        self._lease_started = True

        def renew_forever() -> None:
            while True:
                try:
                    released = self.admission.renew()
                    if released:
                        log.warning("released %d items admitted by API processes that died", released)
                except redis.RedisError as exc:
                    log.debug("could not renew the admission lease: %s", exc)
                time.sleep(self.settings.api_lease_s / 3)

        threading.Thread(target=renew_forever, name="admission-lease", daemon=True).start()

    def _release(self, ticket: Ticket, item_ids: list[str]) -> None:
        try:
            self.admission.release(ticket, item_ids)
        except redis.RedisError:
            pass  # the member expires at its deadline anyway

    def ping(self) -> dict[str, object]:
        """Readiness: broker and Redis reachable, and the live workers. Raises Unavailable otherwise."""
        try:
            self.client.ping()
            workers = self.fleet.live(self.clock())
        except redis.RedisError as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        try:
            self.publisher.ping()
        except BROKER_ERRORS as exc:
            raise Unavailable(f"RabbitMQ is unreachable: {exc}") from None
        if not workers:
            raise Unavailable("no GPU worker is alive (no heartbeat in the last "
                              f"{self.fleet.stale_after_s:g} s); start one with `gpu-worker --gpu 0`")
        return {"workers": len(workers), "models": sorted({w.model for w in workers})}
