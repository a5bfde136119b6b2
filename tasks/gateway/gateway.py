"""The API side of the pipeline, free of HTTP: admit a call, publish it, wait for its outputs.

The web app is a thin shell over :meth:`Gateway.submit`; anything else that submits work (the admin CLI's
replay, a benchmark) can use the same path. This module is the first half of a call: its checks, its turn at
the gate (:mod:`tasks.gateway.gate`), its admission and publishing in a round with the other calls this process
has ready (:mod:`tasks.gateway.rounds`). The wait for its results is :mod:`tasks.gateway.waiting`; idempotent
retries and lookups by id :mod:`tasks.gateway.idempotency`; what each refusal says :mod:`tasks.policy.refusal`;
this process's view of each model's admission queue, which it keeps up to date, :mod:`tasks.gateway.admission_queue`.
It builds none of its Redis and RabbitMQ parts: its process's composition root hands them in (:class:`GatewayParts`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from typing import TypeVar

import redis

from tasks import tracing
from tasks.config import Settings
from tasks.errors import BatchingError, IdempotencyConflict, InvalidInput, NotResumable, Unavailable
from tasks.gateway.admission_queue import AdmissionQueue
from tasks.gateway.calls import Answer, Call, Delta, Done, Event, Events, Lookup, Resumed
from tasks.gateway.gate import NO_GATE, Gate, Turn
from tasks.gateway.idempotency import Replays, replayed
from tasks.gateway.lease import Lease
from tasks.gateway.links import (
    PUBLISH_ERRORS,
    REDIS_TIMEOUT_S,
    broker_refusal,
    live_workers,
    redis_call,
    redis_refusal,
)
from tasks.gateway.parts import GatewayParts
from tasks.gateway.prepared import Joining, Prepared, request_of
from tasks.gateway.resume import Resumer
from tasks.gateway.rounds import ROUND_MAX_CALLS, Rounds
from tasks.gateway.waiting import Entered, ResultWait, Waiter
from tasks.policy.refusal import admission_refusal, deadline_refusal, shortest_answer_s, token_demand
from tasks.policy.stream_position import BadPosition, Position
from tasks.schema import WorkerInfo, input_hash
from tasks.state.admission import AdmitCall, Decision, Ticket
from tasks.state.keys import Keys
from tasks.state.metrics import door_round_calls
from tasks.state.records import Idempotency, Shape

log = logging.getLogger(__name__)
T = TypeVar("T")

# An admission reaching Redis later than this after it was sent is refused by the script itself: its caller
# may have had a timeout by then (503), and admitting it would hold capacity nobody releases.
ADMIT_VALID_S = REDIS_TIMEOUT_S / 2


def _decided(outcomes: Sequence[Waiter | BatchingError | None]) -> list[Waiter | BatchingError]:
    """A round's outcomes once every call of it has one."""
    decided = [o for o in outcomes if o is not None]
    assert len(decided) == len(outcomes), "one outcome per call"
    return decided


class _LineTurn(Turn):
    """A call's turn at the gate that, given up, also ends its place in the admission queue's view."""

    def __init__(self, turn: Turn, through: Callable[[], None]) -> None:
        super().__init__()
        self._turn, self._through = turn, through

    def leave(self) -> None:
        self._turn.leave()
        self._through()


class Gateway:
    """Admits, publishes and waits, on the ``parts`` its process built (:class:`GatewayParts`). ``queue``: this
    process's view of each model's admission queue, which the door reads too; ``gate``: the turnstile in front of
    admission (none: every call goes at once); ``monotonic``: this process's own clock, which its waits run on."""

    def __init__(self, settings: Settings, parts: GatewayParts, queue: AdmissionQueue, gate: Gate | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.gate = gate
        self.queue = queue
        self._monotonic = monotonic
        self._instance_id = parts.instance_id
        self._reply_to = parts.listener.channel
        # Times other hosts compare with (deadlines sent to batchers and workers, heartbeats read) are on the
        # fleet's shared clock; this process's own waits run on its monotonic clock.
        self._clock = parts.clock
        self._admission, self._requests, self._workers = parts.admission, parts.requests, parts.workers
        self._listener, self._journal, self._publisher = parts.listener, parts.journal, parts.publisher
        self._lease = Lease(self._admission, settings.admission.api_lease_s / 3)
        self._replays = Replays(self._requests, self._listener)
        self._resumer = Resumer(self._journal, self._listener, self._clock)
        self._waiting = ResultWait(parts.client, Keys.from_settings(settings), self._admission, self._requests,
                                   self._listener, self._replays, self._clock, journal=self._journal,
                                   resume_s=settings.stores.stream_resume_s)
        # The calls this process has ready at once go to Redis and RabbitMQ together, a light tenant's first.
        self._rounds: Rounds[Joining, Waiter] = Rounds(
            self._admit_round, ROUND_MAX_CALLS,
            lambda: Unavailable("the call's admission round was interrupted; retry"),
            first=lambda joining: queue.light(joining.call.tenant))

    def live_workers(self, fresh: bool = False) -> list[WorkerInfo]:
        """The live fleet; cached for half a heartbeat interval (``fresh``: read it now)."""
        return live_workers(self._workers, fresh)

    def kind_of(self, model: str, named: str | None = None) -> str | None:
        """The kind of model ``model``'s live workers run (``WorkerInfo.kind``). ModelNotFound (404, naming the
        model as ``named``) when no worker serves it or lately did, judged first: a flood of made-up names costs
        no Redis read each. A known model missing from the cached view is read again (the view may predate a
        worker that just started); None when no worker of it is live (the call goes on to the gateway's 503)."""
        kinds = {w.model: w.kind for w in self.live_workers()}
        if model in kinds:
            return kinds[model]
        self.queue.refuse_unknown(model, named)
        return {w.model: w.kind for w in self.live_workers(fresh=True)}.get(model)

    def live_models(self, fresh: bool = False) -> set[str]:
        return {w.model for w in self.live_workers(fresh)}

    def _workers_of(self, model: str) -> list[WorkerInfo] | None:
        """The live workers of ``model`` (None when the fleet cannot be read: that refusal comes later)."""
        try:
            return [w for w in self.live_workers() if w.model == model]
        except BatchingError:
            return None

    def submit(self, call: Call, *, shape: Shape | None = None, idempotency: Idempotency | None = None) -> Answer:
        """Run one call through the pipeline. Raises a :class:`tasks.errors.BatchingError` on any failure.

        Every admitted call is recorded (its items, ``shape``, outcome) for ``GET /v1/requests/<id>``. With
        ``idempotency``, a call whose key already names an earlier call of the tenant is not run: it waits for
        that call (within its own deadline) and gets its answer, or IdempotencyConflict if the body differs."""
        if call.trace is not None:
            return self._traced_submit(call, shape, idempotency)
        entered = self._enter(call, shape or Shape(), idempotency, follow=True)
        if isinstance(entered, Answer):
            return entered
        return self._waiting.answer(call, entered)

    def _traced_submit(self, call: Call, shape: Shape | None, idempotency: Idempotency | None) -> Answer:
        """:meth:`submit` with its ``llmb.admit`` and ``llmb.wait`` spans (``call.trace``: its llmb.call span)."""
        started = self._clock()
        try:
            entered = self._enter(call, shape or Shape(), idempotency, follow=True)
        finally:
            tracing.record("llmb.admit", call.trace, started, self._clock())
        if isinstance(entered, Answer):
            return entered
        wait = tracing.start("llmb.wait", call.trace, at=self._clock())
        error: BaseException | None = None
        try:
            return self._waiting.answer(call, entered)
        except BaseException as exc:
            error = exc
            raise
        finally:
            tracing.end(wait, self._clock(), error)

    def stream(self, call: Call, *, shape: Shape | None = None, idempotency: Idempotency | None = None) -> Events:
        """Admit and publish a call now (so refusals raise here), then return its events (:class:`Event`): each
        item's text as the worker streams it (a Delta), its result as it finishes (a Done), or an error that
        ends the stream. Closing the iterator early (the client went away) cancels the generations in the
        worker, and forgets the call (a retry with its idempotency key runs it again), ``LLMB_STREAM_RESUME_MS``
        later unless the client resumed the stream meanwhile (:meth:`resume`).

        An idempotent retry of a finished stream gets the first call's results, each as one Done; of a stream
        still running, IdempotencyInProgress (409): its text went to the first caller."""
        call = replace(call, params=replace(call.params, stream=True))
        started = self._clock() if call.trace is not None else 0.0
        try:
            entered = self._enter(call, replace(shape or Shape(), stream=True), idempotency, follow=False)
        finally:
            if call.trace is not None:
                tracing.record("llmb.admit", call.trace, started, self._clock())
        if isinstance(entered, Answer):
            return Events(entered.request_id, replayed(entered.results), replayed=True)
        events = self._waiting.events(Ticket(call.tenant, call.model, call.priority), entered)
        return Events(call.request_id, events if call.trace is None else _traced(events, call.trace, self._clock))

    def resume(self, tenant: str, request_id: str, last_event_id: str | None) -> Resumed | None:
        """The tenant's streamed call of this id again, after the event ``last_event_id`` names (None: from the
        start); None: no such call of this tenant. Once this process's cap on resumed streams admits it (429 if
        not), marks it resumed, so that the process its client left does not cancel it. Raises NotResumable (a
        call that was not streamed; an echoed prompt that was not sent) or InvalidInput (an id this stream never
        sent)."""
        found = self.lookup(tenant, request_id)
        if found is None:
            return None
        record = found.record
        if not record.shape.stream or record.shape.route not in ("chat", "completions"):
            raise NotResumable(f"request {request_id!r} was not streamed: GET /v1/requests/{request_id} has its answer")
        try:
            position = Position.parse(last_event_id, len(record.items)) if last_event_id is not None \
                else Position.start(len(record.items))
        except BadPosition as exc:
            raise InvalidInput(f"{exc}; send the id of the last event received") from None
        if record.shape.echo and not all(c.opened for c in position.choices):
            raise NotResumable("a completion that echoes its prompt resumes only after its opening chunks (the "
                               "prompt is not kept)")
        events = self._resumer.events(record, position)  # Overloaded first: a refused resume marks nothing
        redis_call(lambda: self._journal.mark_resumed(tenant, record.request_id, record.items))
        return Resumed(record, position, events)

    def lookup(self, tenant: str, request_id: str) -> Lookup | None:
        """The tenant's call of this id (None: unknown to this tenant, or expired)."""
        return self._replays.lookup(tenant, request_id)

    def start(self) -> None:
        """Start what the first admitted call would start in its round: the admission lease's renewal and the
        result listener (each a thread, a greenlet under gevent, whose start yields to the event loop). Called
        as an API process starts (:meth:`webapp.services.Services.warm_up`); either starts once."""
        self._lease.keep()
        self._listener.start()

    # -- admission -------------------------------------------------------------------------------------
    def _enter(self, call: Call, shape: Shape, idempotency: Idempotency | None, *, follow: bool) -> Entered | Answer:
        """Admit and publish a call (recording it); or, for an idempotent retry, the first call's answer.

        The deadline counts from when the call reached this host: under a burst, time spent waiting for the
        CPU before the handler ran is the caller's time too. A call whose remaining time could not cover one
        batch is refused now (it would only be answered late): 504 if its timeout never could, 429 if the
        wait at the door took it.

        With ``idempotency`` the key is claimed (one Lua call) just before admission; when it names an earlier
        call, that call is followed instead (:meth:`Replays.follow`). Any refusal before the request is published
        releases the key. A model the fleet does not know is refused first, before anything is kept for it."""
        self.queue.refuse_unknown(call.model)
        done = False

        def through() -> None:  # once: when its turn is given up, or when it ends without one
            nonlocal done
            if not done:
                done = True
                self.queue.ended(call.model, call.priority)

        try:
            while True:
                if idempotency is None:  # a retry may be answered from its first call: it needs no room
                    self._still_full(call)
                with self._turn(call.tenant, through) as turn:
                    prepared = self._prepare(call, shape)
                    claim = None
                    if idempotency is not None:
                        self._lease.keep()  # the lease tells whoever follows this call that its process is alive
                        # its record lives under its key from now on (every later write finds it there), not its id
                        prepared = replace(prepared, record=replace(prepared.record, key_hash=idempotency.key_hash))
                        claim = redis_call(partial(self._requests.claim, replace(prepared.record, published=False),
                                                   idempotency, self._clock()))
                    if idempotency is None or claim is None or claim.claimed:
                        return self._admitted(call, prepared, idempotency, turn)
                answer = self._replays.follow(call, idempotency, claim, prepared.deadline, follow)  # turn given up
                if answer is not None:
                    return answer
        finally:  # through admission, whatever came of it: the door's view of the line moves on
            through()

    def _still_full(self, call: Call) -> None:
        """Raise the QueueFull of the model's last FULL verdict while it is fresh (FULL_HOLD_S): the calls of a
        flood are then refused without waiting for a turn or asking Redis, in the time a batch drains a few items."""
        held = self.queue.held_full(call.model, call.priority)
        if held is not None and not self.queue.light(call.tenant):
            raise held

    @contextmanager
    def _turn(self, tenant: str, through: Callable[[], None]) -> Iterator[Turn]:
        """A call's turn through admission (at once when the process has no gate, or for a light tenant). Giving
        it up before the broker's confirm also takes the call out of the door's view of the line (``through``):
        the confirm takes no admission work, and under a broker alarm it takes seconds."""
        passage: AbstractContextManager[Turn] = nullcontext(NO_GATE) if self.gate is None else self.gate.passage(tenant)
        with passage as turn:
            yield _LineTurn(turn, through)

    def _admitted(self, call: Call, prepared: Prepared, idempotency: Idempotency | None, turn: Turn) -> Entered:
        try:
            waiter = self._admit(call, prepared, turn, recorded=idempotency is not None)
        except BaseException:
            if idempotency is not None:
                self._replays.forget(prepared.record, idempotency)
            raise
        return Entered([i.id for i in prepared.request.items], prepared.deadline, prepared.request.accepted_at,
                       prepared.record, idempotency, waiter)

    def _prepare(self, call: Call, shape: Shape) -> Prepared:
        """The checks before admission, and the request (and its record) a call would be admitted as."""
        now = self._monotonic()
        deadline = (call.received_at or now) + call.timeout_ms / 1000
        remaining_s = deadline - now
        refused = deadline_refusal(call.model, call.timeout_ms, remaining_s, now - (call.received_at or now),
                                   shortest_answer_s(self._workers_of(call.model) or []),
                                   self.settings.admission.retry_after_s)
        if refused is not None:
            raise refused
        request, record = request_of(call, shape, self._clock(), remaining_s, self._reply_to, self._instance_id)
        item_tokens, token_cap = token_demand(call.inputs, call.params, call.model,
                                              lambda: self._workers_of(call.model),
                                              self.settings.tenants.kv_admission_factor)
        return Prepared(request, record, remaining_s, deadline, item_tokens, token_cap)

    def _admit(self, call: Call, prepared: Prepared, turn: Turn, *, recorded: bool) -> Waiter:
        """Admit a prepared call, record it (unless its idempotency claim did) and publish it, in a round with the
        other calls this process has ready (:mod:`tasks.gateway.rounds`); its ``turn`` at the gate is given up
        once only the broker's confirm is left to wait for. Returns the result listener's waiter."""
        # the record must exist before any result does: written with the admission (unless its claim wrote it)
        record = None if recorded else self._requests.admitted(prepared.record, self._clock())
        request = prepared.request
        admit = AdmitCall(tuple(i.id for i in request.items), tuple(input_hash(call.model, t) for t in call.inputs),
                          Ticket(call.tenant, call.model, call.priority), request.accepted_at, prepared.remaining_s,
                          self.queue.model_cap(call.tenant, call.model, prepared.remaining_s), call.tenant_cap,
                          tuple(prepared.item_tokens), prepared.token_cap, record)
        joining = Joining(call, prepared, admit, turn)
        if recorded:  # an idempotent call goes alone: a process killed between a round's confirm and its mark
            outcome = self._admit_round([joining], lambda: None)[0]  # would leave the whole round to run twice
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return self._rounds.join(joining)

    def _admit_round(self, calls: Sequence[Joining], hand_on: Callable[[], None]) -> list[Waiter | BatchingError]:
        """One round: admit the calls in one script call, publish those admitted in one message. A listener's
        waiter per call admitted and published, the error it is refused with for the others. The next round
        may start (``hand_on``) while this one waits for the broker's confirm: under a broker alarm that wait is
        the whole publish timeout, and each round must get its 503 within it, not after the rounds before it."""
        door_round_calls().observe(len(calls))
        try:
            self._lease.keep()
            decisions = self._admission.try_admit_many([c.admit for c in calls], self._clock() + ADMIT_VALID_S)
        except redis.RedisError as exc:
            return [redis_refusal(exc) for _ in calls]
        outcomes: list[Waiter | BatchingError | None] = [self._refusal(c, d) for c, d in zip(calls, decisions)]
        admitted = [i for i, outcome in enumerate(outcomes) if outcome is None]
        waiters: dict[int, Waiter] = {}  # the result listener's, once registered
        try:  # after admission, so that a quarantined input is refused as such even while no worker is up
            for i in admitted:
                error = self._unserved(calls[i].call.model)
                if error is not None:
                    outcomes[i] = error
                    self._unadmit(calls[i])
            published = [i for i in admitted if outcomes[i] is None]
            if not published:
                return _decided(outcomes)
            # listening before publishing: a result or streamed text can come back before publish() returns
            for i in published:
                waiters[i] = self._listener.expect(list(calls[i].admit.item_ids))
                calls[i].turn.leave()
            hand_on()
            error = self._mark_sending([calls[i] for i in published]) or self._publish(
                [calls[i].prepared for i in published])
            if error is None:
                self._mark_published([calls[i] for i in published])
            for i in published:
                if error is None:
                    outcomes[i] = waiters.pop(i)
                else:
                    outcomes[i] = error
                    self._unadmit(calls[i], waiters.pop(i))
            return _decided(outcomes)
        except BaseException:
            for i in admitted:
                if outcomes[i] is None:
                    self._unadmit(calls[i], waiters.get(i))
            raise

    def _refusal(self, joining: Joining, decision: Decision) -> BatchingError | None:
        """The error a call is refused with for this admission verdict (None: admitted); a FULL one is held for
        the model and class (:meth:`AdmissionQueue.held_full`)."""
        call, (verdict, bad_hash, ahead) = joining.call, decision
        error = admission_refusal(verdict, bad_hash, ahead, model=call.model, tenant=call.tenant,
                                  tenant_cap=call.tenant_cap, hashes=joining.admit.hashes, workers=self._workers.last,
                                  admission_cap=self.settings.admission.cap,
                                  retry_floor_s=self.settings.admission.retry_after_s)
        self.queue.decided(call.model, call.priority, verdict, ahead, error)  # for the door's view of the queue
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

    def _publish(self, calls: Sequence[Prepared]) -> BatchingError | None:
        """Publish the requests of a round as one message; the error its callers get when that fails."""
        budget = min(self.settings.broker.publish_timeout_s, max(0.0,
                                                                 max(c.deadline for c in calls) - self._monotonic()))
        try:
            self._publisher.publish([c.request for c in calls], budget)
        except PUBLISH_ERRORS as exc:
            return broker_refusal(exc)
        return None

    def _mark_sending(self, calls: Sequence[Joining]) -> BatchingError | None:
        """Mark the records of the idempotent calls (those whose claim wrote the record) as being sent, before
        the publish: a retry takes over the key of a dead process's call only while its record is unmarked, so
        no retried call can run twice. A call whose mark cannot be written is not sent (the error its caller
        gets), nor one whose key a retry took over while this process stalled."""
        records = [c.prepared.record for c in calls if c.admit.record is None]
        if not records:
            return None
        try:
            written = self._requests.published(records, sending=True)
        except redis.RedisError as exc:
            return redis_refusal(exc)
        if None in written:  # Redis lost the records (a restart): nobody holds their keys; not sent, retryable
            return Unavailable("Redis lost this call's idempotency record before it was sent (a restart?); retry")
        if not all(written):
            return IdempotencyConflict("a retry with this Idempotency-Key took the call over while this one waited; "
                                       "its answer is the retry's")
        return None

    def _mark_published(self, calls: Sequence[Joining]) -> None:
        """Mark the idempotent calls' records published once RabbitMQ confirmed them (a retry then waits for
        their answers, not only up to the deadline of a call that may run). Best effort: unmarked, they stay
        "being sent", which is followed as well."""
        records = [c.prepared.record for c in calls if c.admit.record is None]
        if not records:
            return
        try:
            self._requests.published(records)
        except redis.RedisError as exc:
            log.warning("could not mark %d requests published: %s", len(records), exc)

    def _unadmit(self, joining: Joining, waiter: Waiter | None = None) -> None:
        """Undo the admission of a call that will not be published: its items, the record the admission wrote,
        its listener's waiter."""
        ids = list(joining.admit.item_ids)
        self._waiting.release(joining.admit.ticket, ids)
        if joining.admit.record is not None:
            self._replays.forget(joining.prepared.record, None)
        if waiter is not None:
            self._listener.forget(ids, waiter)


def _traced(events: Generator[Event, None, None], parent: str,
            clock: Callable[[], float]) -> Generator[Event, None, None]:
    """A stream's events inside its ``llmb.wait`` span: an event at its first token, ended with the stream."""
    wait = tracing.start("llmb.wait", parent, at=clock())
    error: BaseException | None = None
    first = True
    try:
        for event in events:
            if first and isinstance(event, Delta | Done):
                tracing.event(wait, "first_token")
                first = False
            elif isinstance(event, BatchingError):
                error = event
            yield event
    finally:
        events.close()
        tracing.end(wait, clock(), error)
