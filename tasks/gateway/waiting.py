"""The second half of a call, once it is admitted and published: its results read as they come (each read also
releasing the admission of the items it found, in one round trip shared with the other callers reading at that
moment), its stream relayed, its outcome recorded, and the generation cancelled when its caller is gone."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import redis

from tasks.errors import BatchingError, DeadlineExceeded
from tasks.gateway.calls import Answer, Call, Delta, Done, Event
from tasks.gateway.idempotency import Replays
from tasks.gateway.links import redis_refusal
from tasks.gateway.rounds import ROUND_MAX_CALLS, Rounds
from tasks.policy.refusal import error_of
from tasks.schema import ItemResult
from tasks.state.admission import Admission, CollectCall, Ticket
from tasks.state.journal import Journal
from tasks.state.keys import Keys
from tasks.state.records import Idempotency, Outcome, Record
from tasks.state.requests import Requests
from tasks.state.results import ResultListener
from tasks.state.results import _Waiter as Waiter  # the listener's handle on a call's items (no public name yet)

log = logging.getLogger(__name__)
Read = Callable[[Sequence[str]], list[bytes | None]]


@dataclass(frozen=True)
class Entered:
    """A call admitted and published by this process."""

    ids: list[str]
    deadline: float  # monotonic
    accepted_at: float
    record: Record
    idempotency: Idempotency | None
    waiter: Waiter  # the result listener's, registered before the request was published


class ResultWait:
    """Waits for admitted calls' results and records how each ended."""

    def __init__(self, client: redis.Redis, keys: Keys, admission: Admission, requests: Requests,
                 listener: ResultListener, replays: Replays, clock: Callable[[], float], *,
                 journal: Journal | None = None, resume_s: float = 0.0) -> None:
        self.client = client
        self.journal = journal  # where a stream's client marks that it came back
        self.resume_s = resume_s  # how long a stream whose client left waits for it to come back
        self.keys = keys
        self.admission = admission
        self.requests = requests
        self.listener = listener
        self.replays = replays
        self.clock = clock
        self.result_key = keys.result
        # The result reads this process has ready at once go to Redis together.
        self.reads: Rounds[CollectCall, tuple[list[bytes | None], bool]] = Rounds(
            lambda calls, hand_on: self.admission.collect_many(calls), ROUND_MAX_CALLS,
            lambda: redis.ConnectionError("the round reading the results was interrupted"))

    def _reader(self, ticket: Ticket) -> Read:
        """Reads a call's results and releases the admission of those that have one, in one round trip (shared
        with the other callers reading at the same moment: :attr:`reads`)."""
        return lambda ids: self.reads.join(CollectCall(ticket, tuple(ids), tuple(self.result_key(i) for i in ids)))[0]

    def _finishing_reader(self, ticket: Ticket, entered: Entered, started: float, finished: list[float]) -> Read:
        """:meth:`_reader`, which also records a successful outcome when one read finds every result (a call
        without an idempotency key: its outcome is then written in the same round trip); ``finished`` gets the
        call's total_ms when it did."""
        every = len(entered.ids)

        def read(ids: Sequence[str]) -> list[bytes | None]:
            keys = tuple(self.result_key(i) for i in ids)
            if len(ids) < every:
                return self.reads.join(CollectCall(ticket, tuple(ids), keys))[0]
            total_ms = round((time.monotonic() - started) * 1000, 1)
            record = self.requests.finished(entered.record, Outcome(total_ms=total_ms))
            values, done = self.reads.join(CollectCall(ticket, tuple(ids), keys, record))
            if done:
                finished.append(total_ms)
            return values

        return read

    def answer(self, call: Call, entered: Entered) -> Answer:
        """Wait for every result of an admitted call (within its deadline) and record its outcome; raises the
        call's error (DeadlineExceeded, an item's own, Unavailable without Redis)."""
        ids, deadline, idempotency = entered.ids, entered.deadline, entered.idempotency
        ticket = Ticket(call.tenant, call.model, call.priority)
        started = call.received_at or entered.deadline - call.timeout_ms / 1000
        found: dict[str, ItemResult] = {}
        finished: list[float] = []  # total_ms, once the read that found every result also recorded the outcome
        try:
            found = self.listener.wait(ids, deadline, self._finishing_reader(ticket, entered, started, finished)
                                       if idempotency is None else self._reader(ticket), waiter=entered.waiter)
        except redis.RedisError as exc:
            raise redis_refusal(exc, " while waiting for the result", busy_is_overload=False) from None
        finally:  # items with a result were released as they were read: release the rest
            self.release(ticket, [i for i in ids if i not in found])
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

    def events(self, ticket: Ticket, entered: Entered) -> Generator[Event, None, None]:
        """A streamed call's events: each item's Delta as the worker streams it and its Done as it finishes; an
        error (an item's own, or the deadline passing first) ends the stream, the other items cancelled. The
        outcome is recorded once every item is done. Closed early (the client went away), the generations go on
        for ``resume_s`` (the client may resume the stream from any API process: :mod:`tasks.gateway.resume`);
        if it has not come back by then, the call is forgotten and its unfinished generations cancelled."""
        index = {item_id: i for i, item_id in enumerate(entered.ids)}
        results: dict[str, ItemResult] = {}
        settled = False
        try:
            for kind, item_id, value in self.listener.stream(entered.ids, entered.deadline, self._reader(ticket),
                                                             waiter=entered.waiter):
                if kind == "delta":
                    yield Delta(index[item_id], *value)
                elif kind == "done" and not value.error:
                    results[item_id] = value
                    if len(results) == len(entered.ids):
                        settled = self._settle(entered, None, results=tuple(results[i] for i in entered.ids))
                    yield Done(index[item_id], value)
                else:
                    error = error_of(value) if kind == "done" else DeadlineExceeded(
                        "no complete output before the deadline")
                    if kind == "done":
                        results[item_id] = value
                    settled = self._settle(entered, error, results=tuple(results.values()))
                    yield error
                    return
        except redis.RedisError as exc:
            settled = True  # nothing can be recorded now; the record keeps what it had
            yield redis_refusal(exc, " while streaming", busy_is_overload=False)
        finally:
            unfinished = [i for i in entered.ids if i not in results]
            if settled or not self._later(ticket, entered, unfinished):
                self._abandon(ticket, entered, unfinished, settled)

    def _later(self, ticket: Ticket, entered: Entered, unfinished: list[str]) -> bool:
        """Look at a stream its client left again in ``resume_s`` (the client may resume it meanwhile); False:
        now (no window, or no timer could be started)."""
        if self.resume_s <= 0 or self.journal is None:
            return False
        try:
            timer = threading.Timer(self.resume_s, self._left, (ticket, entered, unfinished))
            timer.daemon = True
            timer.start()
        except RuntimeError:  # no thread (or greenlet) to be had: cancel at once rather than never
            return False
        return True

    def _left(self, ticket: Ticket, entered: Entered, unfinished: list[str]) -> None:
        """``resume_s`` after a stream's client left: the items that finished meanwhile are released (and, if all
        did, the call's outcome recorded: it ran, so a retry of its key gets it); if the client came back, the
        rest run on and are looked at again in ``resume_s``, until their deadline; if not, the call is
        forgotten and the rest cancelled (:meth:`_abandon`)."""
        record = entered.record
        try:
            found = self.listener.fetch(entered.ids)  # one read: what finished meanwhile, and whether all did
            self.release(ticket, [i for i in unfinished if i in found])
            rest = [i for i in unfinished if i not in found]
            if len(found) == len(entered.ids):
                failed = next((r for r in found.values() if r.error), None)
                self._settle(entered, None if failed is None else error_of(failed),
                             results=tuple(found[i] for i in entered.ids))
                return
            assert self.journal is not None
            if self.journal.resumed(record.tenant, record.request_id, record.items):
                if rest and time.monotonic() < entered.deadline and self._later(ticket, entered, rest):
                    return  # its client came back: it runs on
                self.release(ticket, rest)
                return
        except redis.RedisError as exc:
            log.warning("could not look at the stream of request %s its client left: %s", record.request_id, exc)
            rest = unfinished
        self._abandon(ticket, entered, rest)

    def _abandon(self, ticket: Ticket, entered: Entered, unfinished: list[str], settled: bool = False) -> None:
        """A stream's call ended in an error (``settled``), or its client went away and did not come back: the
        call is forgotten (before its generation stops: a retry must not find a cancelled output) and what is
        unfinished cancelled."""
        record = entered.record
        if not settled:
            log.info("the client of stream %s went away: cancelling %d item(s)", record.request_id, len(unfinished))
            self.replays.forget(record, entered.idempotency)
        if unfinished:
            self.cancel(unfinished)
            self.release(ticket, unfinished)

    def _settle(self, entered: Entered, error: BatchingError | None, total_ms: float = 0.0,
                results: Sequence[ItemResult] = ()) -> bool:
        """Record how an admitted call ended (best effort: without Redis its results are the record); with its
        ``results``, the record expires with the first of them."""
        outcome = Outcome(total_ms=total_ms) if error is None else Outcome(error.type, error.message)
        written_at = min((r.started_at + r.run_ms / 1000 for r in results), default=None)
        try:
            self.requests.finish(entered.record, outcome, entered.idempotency, self.clock(), written_at)
        except redis.RedisError as exc:
            log.warning("could not record the outcome of request %s: %s", entered.record.request_id, exc)
        return True

    def cancel(self, item_ids: list[str]) -> None:
        """Tell the workers these callers are gone, so generation for them stops (best effort)."""
        with contextlib.suppress(redis.RedisError):
            self.client.publish(self.keys.cancel, ",".join(item_ids))

    def release(self, ticket: Ticket, item_ids: list[str]) -> None:
        """Give back the admission of these items (best effort)."""
        with contextlib.suppress(redis.RedisError):  # the member expires at its deadline anyway
            self.admission.release(ticket, item_ids)
