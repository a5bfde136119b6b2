"""A streamed call's events again, from where its client's connection stopped, on any API process.

The client names the last event it got (its SSE id, a :class:`tasks.policy.stream_position.Position`); what it
lacks comes from Redis, where nothing depends on the API process that ran the call: each unfinished choice's
text from the worker's journal (:mod:`tasks.state.journal`), piece by piece as the worker streams it (the same
pieces the first stream sent, so the same events), and each choice's end from its result. A choice whose
position the journal no longer covers (trimmed, or the journal expired) gets the rest of its text with its end.
The events are the gateway's (:class:`tasks.gateway.calls.Event`), so the route renders them as the first
stream did; a finished choice's Done comes too (the usage chunk counts it), and the renderer sends nothing for it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import redis

from tasks.errors import DeadlineExceeded, Overloaded
from tasks.gateway.calls import Delta, Done, Event
from tasks.gateway.links import redis_refusal
from tasks.policy.refusal import error_of
from tasks.policy.stream_position import Position, text_after
from tasks.state.journal import Journal
from tasks.state.records import OUTCOME_GRACE_S, Record
from tasks.state.results import ResultListener

POLL_S = 0.05  # a resumed stream with nothing new reads the journal and results again after this long
MAX_RESUMING = 64  # resumed streams one API process serves at once (each reads Redis every POLL_S)...
MAX_RESUMING_PER_TENANT = 8  # ... and of them, one tenant's: the rest are refused (429), not queued


class Resumer:
    def __init__(self, journal: Journal, listener: ResultListener, clock: Callable[[], float]) -> None:
        self.journal = journal
        self.listener = listener
        self.clock = clock  # the shared clock: the record's deadline is on it
        self.resuming: dict[str, int] = {}  # tenant -> resumed streams this process serves now

    def events(self, record: Record, position: Position) -> Iterator[Event]:
        """What the client at ``position`` lacks of the call's choices (their text, then each one's Done), or
        an error that ends the stream (an item's own, the call's deadline passing first, Redis away: 503).
        Overloaded (429) at once when this process serves :data:`MAX_RESUMING` resumed streams, or the
        tenant :data:`MAX_RESUMING_PER_TENANT`."""
        tenant = record.tenant
        if sum(self.resuming.values()) >= MAX_RESUMING or self.resuming.get(tenant, 0) >= MAX_RESUMING_PER_TENANT:
            raise Overloaded("this API process serves as many resumed streams as it may now; retry in a moment",
                             retry_after_s=1)
        return self._counted(record, position)

    def _counted(self, record: Record, position: Position) -> Iterator[Event]:
        # counted once it runs (a response closed before its first byte never runs it, nor its finally)
        self.resuming[record.tenant] = self.resuming.get(record.tenant, 0) + 1
        try:
            yield from self._events(record, position)
        except redis.RedisError as exc:
            yield redis_refusal(exc, " while resuming the stream", busy_is_overload=False)
        finally:
            left = self.resuming[record.tenant] - 1
            if left:
                self.resuming[record.tenant] = left
            else:
                del self.resuming[record.tenant]

    def _events(self, record: Record, position: Position) -> Iterator[Event]:
        ids = record.items
        pending = {i for i, c in enumerate(position.choices) if not c.finished}
        finished = self.listener.fetch([ids[i] for i in range(len(ids)) if i not in pending])
        for i in sorted(set(range(len(ids))) - pending):
            if ids[i] in finished:
                yield Done(i, finished[ids[i]])
        text = _Text(self.journal, ids, position)
        while pending:
            # polled, not a blocking XREAD: a resumed stream holds a connection of the process's shared pool
            # only for a round trip
            fresh = list(text.read(sorted(pending)))
            yield from fresh
            results = self.listener.fetch([ids[i] for i in sorted(pending)])
            ended = [i for i in sorted(pending) if ids[i] in results]
            if ended:  # a worker journals an item's text before it writes its result: read the last pieces
                yield from text.read(ended)
            for i in ended:
                result = results[ids[i]]
                if result.error:
                    yield error_of(result)
                    return
                pending.discard(i)
                yield Done(i, result)
            if pending and self.clock() > record.deadline + OUTCOME_GRACE_S:
                yield DeadlineExceeded("no complete output before the deadline")
                return
            if pending and not fresh:
                time.sleep(POLL_S)  # a greenlet's sleep under gevent


class _Text:
    """The journal of a call's choices read on from where its client is: each piece's part it lacks."""

    def __init__(self, journal: Journal, ids: Sequence[str], position: Position) -> None:
        self.journal = journal
        self.ids = ids
        self.sent = [c.sent for c in position.choices]
        self.after = {item_id: "0-0" for item_id in ids}  # the last journal entry read, per item
        self.gap: set[int] = set()  # choices whose next piece the journal lost: their rest comes with their end

    def read(self, choices: list[int]) -> Iterator[Delta]:
        pieces = self.journal.read({self.ids[i]: self.after[self.ids[i]] for i in choices})
        for i in choices:
            for entry_id, offset, piece in pieces.get(self.ids[i], ()):
                self.after[self.ids[i]] = entry_id
                if offset > self.sent[i]:
                    self.gap.add(i)
                rest = "" if i in self.gap else text_after(self.sent[i], offset, piece)
                if rest:
                    yield Delta(i, rest, self.sent[i])
                    self.sent[i] += len(rest)
