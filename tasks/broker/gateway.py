"""The API side of the pipeline, free of HTTP: admit a call, publish it, wait for its outputs.

The web app is a thin shell over :meth:`Gateway.submit`; anything else that submits work (the admin CLI's
replay, a benchmark) can use the same path.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis
from amqp.exceptions import AMQPError
from kombu.exceptions import KombuError

from tasks.broker.queues import PublisherBusy, PublishTimeout, RequestPublisher
from tasks.config import Settings
from tasks.errors import (
    BatchingError,
    DeadlineExceeded,
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
from tasks.state.admission import Admission, Ticket, Verdict
from tasks.state.clock import SharedClock
from tasks.state.connect import PoolExhausted
from tasks.state.fleet import Fleet, FleetCache
from tasks.state.keys import Keys
from tasks.state.results import ResultListener

log = logging.getLogger(__name__)

BROKER_ERRORS = (KombuError, AMQPError, OSError)
REDIS_TIMEOUT_S = 5.0  # an API process's Redis commands: longest wait for an answer
# An admission reaching Redis later than this after it was sent is refused by the script itself: its caller
# may have had a timeout by then (503), and admitting it would hold capacity nobody releases.
ADMIT_VALID_S = REDIS_TIMEOUT_S / 2


def redis_client(settings: Settings) -> redis.Redis:
    """The Redis client of an API process: one bounded pool shared by all of its waiting callers (a plain Redis
    or the master behind Sentinel, as ``LLMB_REDIS_URL`` says); a caller that waits 5 s for a connection gets
    :class:`PoolExhausted`."""
    return connect.redis_client(settings, max_connections=settings.redis_pool_size, pool_timeout_s=5,
                                socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=2)


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


class Gateway:
    def __init__(self, settings: Settings, client: redis.Redis, publisher: RequestPublisher, instance_id: str) -> None:
        self.settings = settings
        self.client = client
        self.publisher = publisher
        self.keys = Keys.from_settings(settings)
        self.reply_to = self.keys.replies(instance_id)
        self.admission = Admission.from_settings(settings, client, instance_id)
        self._lease_started = False
        # Times other hosts compare with (deadlines sent to batchers and workers, heartbeats read) are on the
        # fleet's shared clock; this process's own waits run on its monotonic clock.
        self.clock = SharedClock.from_settings(settings, client)
        self.fleet = Fleet.from_settings(settings, client)
        # A stopping worker still serves its model: a rolling restart must not flap it to 503.
        self.workers = FleetCache(self.fleet, settings.heartbeat_interval_s / 2, draining=True, wallclock=self.clock)
        self.result_key = self.keys.result
        self.listener = ResultListener(client, self.reply_to, self.result_key, settings.result_recheck_ms / 1000)

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
        """Reads a call's results and releases the admission of those that have one, in one round trip."""
        return lambda ids: self.admission.collect(ticket, ids, [self.result_key(i) for i in ids])

    def submit(self, call: Call) -> Answer:
        """Run one call through the pipeline. Raises a :class:`tasks.errors.BatchingError` on any failure."""
        ids, deadline, accepted_at = self._enter(call)
        ticket = Ticket(call.tenant, call.model, call.priority)
        found: dict[str, ItemResult] = {}
        try:
            found = self.listener.wait(ids, deadline, self._reader(ticket))
        except redis.RedisError as exc:
            raise Unavailable(f"Redis is unreachable while waiting for the result: {exc}") from None
        finally:  # items with a result were released as they were read: release the rest
            self._release(ticket, [i for i in ids if i not in found])
        if len(found) < len(ids):
            self.cancel([i for i in ids if i not in found])
            raise DeadlineExceeded(f"no output within {call.timeout_ms} ms (deadline passed)")
        results = tuple(found[i] for i in ids)
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            raise error_of(failed)
        return Answer(results=results, accepted_at=accepted_at)

    def stream(self, call: Call) -> Generator[tuple[str, Any], None, None]:
        """Admit and publish a one-input call now (so refusals raise here), then return its events:
        ("delta", text) as the worker streams, then ("done", ItemResult) or ("error", BatchingError).
        Closing the iterator early (the client went away) cancels the generation in the worker."""
        if len(call.inputs) != 1:
            raise InvalidInput("streaming takes exactly one prompt")
        ids, deadline, _ = self._enter(replace(call, params={**call.params, "stream": True}))
        return self._events(Ticket(call.tenant, call.model, call.priority), ids[0], deadline)

    def _events(self, ticket: Ticket, item_id: str, deadline: float) -> Generator[tuple[str, Any], None, None]:
        finished = False
        try:
            for kind, value in self.listener.stream(item_id, deadline, self._reader(ticket)):
                if kind == "delta":
                    yield kind, value
                elif kind == "done":
                    finished = True
                    yield ("error", error_of(value)) if value.error else ("done", value)
                else:
                    yield "error", DeadlineExceeded("no complete output before the deadline")
        except redis.RedisError as exc:
            yield "error", Unavailable(f"Redis is unreachable while streaming: {exc}")
        finally:
            if not finished:
                self.cancel([item_id])
                self._release(ticket, [item_id])

    def cancel(self, item_ids: list[str]) -> None:
        """Tell the workers these callers are gone, so generation for them stops (best effort)."""
        try:
            self.client.publish(self.keys.cancel, ",".join(item_ids))
        except redis.RedisError:
            pass

    def _enter(self, call: Call) -> tuple[list[str], float, float]:
        """Admit and publish a call; returns its item ids, monotonic deadline and acceptance time.

        The deadline counts from when the call reached this host: under a burst, time spent waiting for the
        CPU before the handler ran is the caller's time too. A call whose remaining time could not cover one
        batch is refused now (it would only be answered late): 504 if its timeout never could, 429 if the
        wait at the door took it."""
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
        ids = [i.id for i in items]
        request = InferenceRequest(
            id=call.request_id, tenant=call.tenant, model=call.model, items=items,
            accepted_at=accepted_at, deadline=accepted_at + remaining_s, reply_to=self.reply_to,
            params=call.params, weight=call.weight, priority=call.priority,
        )
        hashes = [input_hash(call.model, text) for text in call.inputs]
        ticket = Ticket(call.tenant, call.model, call.priority)
        item_tokens, token_cap = self._token_demand(call)
        try:
            self._keep_lease()
            verdict, bad_hash, ahead = self.admission.try_admit(
                ids, hashes, ticket=ticket, now=accepted_at, timeout_s=remaining_s,
                model_cap=self.cap_for(call.model, remaining_s), tenant_cap=call.tenant_cap,
                valid_until=self.clock() + ADMIT_VALID_S, tokens=item_tokens, token_cap=token_cap)
        except PoolExhausted as exc:
            raise _overloaded(exc) from None
        except redis.RedisError as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        if verdict is Verdict.LATE:
            raise Unavailable("Redis answered too late to admit the call (a slow or interrupted link); retry")
        if verdict is Verdict.QUARANTINED:
            raise PoisonInput(f"input {hashes.index(bad_hash or '')} is quarantined (hash {bad_hash}): it failed "
                              "alone before; an operator can release it with "
                              f"`llmb-admin quarantine release {bad_hash}`")
        if verdict is Verdict.TENANT_FULL:
            cap = call.tenant_cap or self.settings.admission_cap
            raise TenantOverLimit(
                f"tenant {call.tenant!r} is at its cap of {cap} items in flight; retry when some are answered "
                "(other tenants are not affected)", retry_after_s=self._retry_after(call.model, ahead))
        if verdict is Verdict.TOKENS_FULL:
            raise QueueFull(f"the KV memory of every worker serving {call.model!r} is spoken for ({ahead} tokens "
                            "admitted and unanswered); retry later", retry_after_s=self.settings.retry_after_s)
        if verdict is Verdict.FULL:
            raise QueueFull(
                "the service is full: no room to answer this request within its deadline; retry later",
                retry_after_s=self._retry_after(call.model, ahead),
            )
        try:  # after admission, so that a quarantined input is refused as such even while no worker is up
            models = self.live_models()
            if call.model not in models:  # before refusing, make sure: the cached view may predate a worker
                models = self.live_models(fresh=True)
            if call.model not in models:
                served = ", ".join(sorted(models)) or "none"
                raise Unavailable(f"no live GPU worker serves model {call.model!r} (models served now: {served})")
            self.listener.start()
            try:
                budget = min(self.settings.publish_timeout_s, max(0.0, deadline - time.monotonic()))
                self.publisher.publish(request, budget)
            except PublishTimeout as exc:
                raise Unavailable(f"{exc} (is it blocked by a memory or disk alarm?); retry later") from None
            except PublisherBusy as exc:
                raise _overloaded(exc) from None
            except BROKER_ERRORS as exc:
                raise Unavailable(f"RabbitMQ is unreachable: {exc}") from None
        except BaseException:
            self._release(ticket, ids)
            raise
        return ids, deadline, accepted_at

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
