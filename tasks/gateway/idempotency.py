"""Recorded calls, read back: what a call came to (``GET /v1/requests/<id>``), and an idempotent retry following
the first call of its key to that call's answer instead of running again."""
from __future__ import annotations

import logging
import time
from collections.abc import Generator
from functools import partial

import redis

from tasks.errors import BatchingError, DeadlineExceeded, IdempotencyConflict, IdempotencyInProgress, error_of_type
from tasks.gateway.calls import Answer, Call, Done, Event, Lookup
from tasks.gateway.links import redis_call
from tasks.policy.refusal import error_of
from tasks.schema import ItemResult
from tasks.state.records import Idempotency, Outcome, Record, State, View
from tasks.state.requests import Claim, Requests
from tasks.state.results import ResultListener

log = logging.getLogger(__name__)

FOLLOW_CHECK_S = 0.2  # an idempotent retry waiting on the first call looks at its record this often
OUTCOME_POLL_S = 0.05  # ... and this often once the results are in, until the live first call records its answer


def replayed_error(record: Record, outcome: Outcome) -> BatchingError:
    """The error a recorded call was answered with, again (same type and message; the first's id)."""
    return error_of_type(outcome.type, outcome.message, replay_of=record.request_id)


def replayed(results: tuple[ItemResult, ...]) -> Generator[Event, None, None]:
    """A finished stream's events, for an idempotent retry: each item's whole result at once."""
    for index, result in enumerate(results):
        yield Done(index, result)


class Replays:
    """Reads what recorded calls came to, and lets a retry wait (within its own deadline) for its first call."""

    def __init__(self, requests: Requests, listener: ResultListener) -> None:
        self.requests = requests
        self.listener = listener

    def lookup(self, tenant: str, request_id: str) -> Lookup | None:
        """The tenant's call of this id (None: unknown to this tenant, or expired)."""
        view = redis_call(partial(self.requests.look, tenant, request_id))
        return None if view is None else redis_call(partial(self.outcome_of, view))

    def outcome_of(self, view: View) -> Lookup | None:
        """What a recorded call came to, from its record and its results (None: its results expired)."""
        record = view.record
        outcome = record.outcome
        running = Lookup(record, State.RUNNING, view.present)
        if outcome is not None and outcome.failed:
            return Lookup(record, State.FAILED, view.present, error=replayed_error(record, outcome))
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

    def follow(self, call: Call, idempotency: Idempotency, claim: Claim, deadline: float,
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
            found = redis_call(partial(self.outcome_of, view))
            if found is None:  # its record outlived its results: nothing to answer with; run it again
                self.forget(view.record, idempotency)
                return None
            if found.state is not State.RUNNING:
                if found.error is not None:
                    raise found.error
                assert found.answer is not None
                return found.answer
            if not follow:
                raise IdempotencyInProgress(
                    f"the stream of request {view.record.request_id!r} with this Idempotency-Key is still running; "
                    "resume it (GET /v1/requests/<id>/stream with Last-Event-ID) or retry once it has finished")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"no output within {call.timeout_ms} ms: request "
                                       f"{view.record.request_id!r} with this Idempotency-Key is still running")
            if view.present == len(view.record.items):  # the answer is in; the first call is recording it
                time.sleep(min(OUTCOME_POLL_S, remaining))
            else:  # woken with the first call's own waiter when it runs in this process
                items, until = view.record.items, min(deadline, time.monotonic() + FOLLOW_CHECK_S)
                redis_call(partial(self.listener.wait, items, until))
            claim = redis_call(partial(self.requests.peek, call.tenant, idempotency))

    def forget(self, record: Record, idempotency: Idempotency | None) -> None:
        """Drop a call's record (and its key): a retry runs it again. Best effort."""
        try:
            self.requests.release(record, idempotency)
        except redis.RedisError as exc:  # the key expires with its TTL
            log.warning("could not forget request %s: %s", record.request_id, exc)
