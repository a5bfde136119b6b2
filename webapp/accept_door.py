"""The door at accept: an inference request refused from its bytes already arrived, before gunicorn parses it or
Flask takes it: as it arrives, when its model's line is longer than the fleet can answer in its time; and
while the process is behind or a FULL verdict is fresh."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gevent

from tasks.config import Settings
from tasks.errors import QueueFull
from tasks.policy import strict_json
from tasks.policy.room import Placed
from tasks.policy.shedding import Door
from tasks.schema import Priority
from webapp.connections import AtDoor
from webapp.door import NAME_MAX, DoorIdentity, refusal
from webapp.errors import status_of
from webapp.peek import Peeked, partly_arrived, peek_request, tenant_of
from webapp.validation import asks_offline, bearer_token, named_tenant, priority_class, timeout_limit_ms

if TYPE_CHECKING:
    from tasks.gateway.admission_queue import AdmissionQueue
    from tasks.store.directory import TenantDirectory


# An arriving request whose body is not all there yet is looked at again this many times, this far apart, while
# a line is forming (calls let in on arrival wait for admission) or the process is behind: those are the times
# a call let through unjudged would upset the count. Otherwise it goes the usual way at once: at light load, 12 of
# 100 calls of requests.Session and httpx clients waited 2.2 ms for their body that way (aiohttp's: none of 200).
BODY_WAIT_TRIES = 3
BODY_WAIT_S = 0.002


class AcceptDoor:
    """The door at accept: while the process is behind, a request is refused from its bytes already arrived,
    before gunicorn parses it or a greenlet is spawned for it; and so is one arriving beyond what its model's
    line can answer in time (:class:`QueueShedding`), before it waits its turn at intake.

    Under a flood the refusals are most of the work: at three times the capacity of one 250 ms device, two
    API processes refuse 800 requests a second, and gunicorn's parsing, the WSGI environ and the response cost
    about half a millisecond each, enough with the admitted calls to keep the processes behind, and then everything is
    refused, the admitted calls' own round trips waiting behind the refusals. Here a refusal is a peek at the
    socket, a few header lookups, one write and a close. Anything this does not handle plainly (a request not
    all arrived yet, no Content-Length, chunked, not an inference call) goes the usual way, to be refused or let
    in by :class:`DoorMiddleware` with the same rules."""

    def __init__(self, door: Door, is_inference: Callable[[str], bool], shedding: QueueShedding | None = None,
                 identity: DoorIdentity | None = None) -> None:
        self.door = door
        self.is_inference = is_inference
        self.shedding = shedding
        self.identity = identity or DoorIdentity()

    def __call__(self, sock: socket.socket, delay: float | None = None, *, arriving: bool = False,
                 arrived_at: float | None = None, in_line: bool = False, at_accept: bool = False) -> AtDoor:
        """Refuse the request on this connection if the door would (by its ``delay`` so far, or by the delay
        expected now), or the gateway would for want of room (REFUSED: answered; the caller closes the
        connection).

        ``arriving``: its bytes have just come (it arrived at ``arrived_at``, where its deadline starts; None:
        now), and it is judged by its place in its model's admission queue (:class:`QueueShedding`): IN_LINE when
        that let it in; LIGHT when it is a light caller's (not held to the line: taken in at once).
        ``arrived_at`` also times a refusal from the request's arrival (:func:`webapp.door.refusal`).
        ``in_line``: such a request at its intake turn, ``delay`` after its arrival: only lateness refuses it then
        (its line was judged when it arrived; the expected wait at the gate would judge it twice). The door in
        front of Flask (:class:`webapp.door.DoorMiddleware`) only by lateness.
        ``at_accept``: arriving on a connection just accepted, before its greenlet runs (nothing waits for a
        trailing body there): UNSEEN when it was not judged, its bytes not all there yet."""
        judging = arriving and self.shedding is not None
        unjudged = AtDoor.UNSEEN if at_accept else AtDoor.USUAL
        late_only = in_line and delay is not None
        behind = self.door.lateness(delay).late if late_only else self.door.behind_at_accept(delay)  # type: ignore[arg-type]
        if not behind and not judging and (self.shedding is None or not self.shedding.any_held()):
            return unjudged
        patient = judging and not at_accept and (behind or self.shedding.forming())  # type: ignore[union-attr]
        request = _arrived_whole(sock, BODY_WAIT_TRIES if patient else 0) if judging else peek_request(sock)
        if request is None:
            return unjudged
        if not self.is_inference(request.path):
            return AtDoor.USUAL
        caller = self._caller_of(request)
        if judging:  # every arrival counts towards who sends what (its entry at the door counts it again)
            self.door.callers.arrived(caller)
        # a light caller is held neither to a flood's FULL verdict nor to its line (the gateway lets it past: it
        # is served fairly), nor on arrival to the line at intake; nor is a caller the door cannot name (as at the
        # gate)
        light = bool(caller) and self.door.callers.light(caller)
        call = None if self.shedding is None or light else self.shedding.judged(request)
        error: QueueFull | None = None if call is None else self.shedding.held(call)  # type: ignore[union-attr]
        if error is None and behind:
            error = self.door.refusal_at_accept(caller, delay)
        elif error is not None and not judging:
            self.door.callers.arrived(caller)  # counted as if it had entered, as the gateway's refusal would be
        outcome = AtDoor.LIGHT if judging and light else AtDoor.USUAL
        if error is None and judging and call is not None:
            placed = self.shedding.place(call, arrived_at)  # type: ignore[union-attr]
            if isinstance(placed, QueueFull):  # Overloaded among them
                error = placed
            elif placed is Placed.IN_LINE:
                outcome = AtDoor.IN_LINE
        if error is None:
            return outcome
        headers, body = refusal(error, request.path, request.headers.get("x-request-id"), arrived_at)
        head = "".join(f"{k}: {v}\r\n" for k, v in [*headers, ("Connection", "close")])
        try:
            sock.settimeout(0.0)
            sock.recv(request.size)  # all there: the peek saw it
            sock.sendall(f"HTTP/1.1 {status_of(error.type)} Too Many Requests\r\n{head}\r\n".encode("latin-1") + body)
        except OSError:
            pass  # the caller is gone, or the response did not fit at once: it is closed all the same
        return AtDoor.REFUSED

    def caller(self, sock: socket.socket) -> str:
        """Who sends the request arriving on ``sock``, as the door counts callers ("" when it cannot tell from the
        bytes arrived): its line at intake (:class:`webapp.intake.Intake`)."""
        request = peek_request(sock)
        return "" if request is None else self._caller_of(request)

    def _caller_of(self, request: Peeked) -> str:
        caller = self.identity(request.headers.get("authorization"), request.headers.get("x-tenant"))
        if not caller and self.identity.in_body:
            caller = tenant_of(request.body)[:NAME_MAX]
        return caller


def _arrived_whole(sock: socket.socket, tries: int) -> Peeked | None:
    """The request arriving on ``sock``, looked at again up to ``tries`` times while its body is a moment behind
    its headers (clients that write them separately); None if it is not all there by then (the usual way)."""
    request = peek_request(sock)
    for _ in range(tries):
        if request is not None or not partly_arrived(sock):
            break
        gevent.sleep(BODY_WAIT_S)
        request = peek_request(sock)
    return request


@dataclass(frozen=True)
class Judged:
    """What the door can tell of a call from its bytes alone."""

    model: str
    priority: Priority
    timeout_s: float


class QueueShedding:
    """This process's view of each model's admission queue (:class:`tasks.gateway.admission_queue.AdmissionQueue`),
    applied at accept: its fresh FULL verdicts (:meth:`~tasks.gateway.admission_queue.AdmissionQueue.held_full`)
    and the place a request arriving now would take (:meth:`~tasks.gateway.admission_queue.AdmissionQueue.place`).

    Under a flood most calls are refused for want of room, after gunicorn, Flask, authentication and the body's
    parsing have run (about half a millisecond each), and under a burst only once their turn at admission has
    come (seconds). Here the same refusal goes out from the request's bytes as they arrive, when the door can
    tell its model, class and timeout without I/O: the model from the body (or the default), the class from the
    body and the caller's tenant as the caches know it. A caller they do not know yet (a key not looked up, a
    tenant not seen), a body that is not a small JSON object, or a retry with an Idempotency-Key (it may be
    answered from its first call) goes the usual way."""

    def __init__(self, queue: AdmissionQueue, tenants: TenantDirectory, settings: Settings) -> None:
        self.queue = queue
        self.tenants = tenants
        self.default_model = settings.models.default_model
        self.default_timeout_s = settings.admission.default_timeout_ms / 1000
        # past the largest timeout a call may give, its 400 comes the usual way (never a place held for it)
        self.max_timeout_ms = timeout_limit_ms(settings)
        self.keys = settings.tenants.auth != "none"

    def any_held(self) -> bool:
        return self.queue.holds_full()

    def forming(self) -> bool:
        """Whether calls let in on arrival wait for admission (:meth:`AdmissionQueue.forming`)."""
        return self.queue.forming()

    def held(self, call: Judged) -> QueueFull | None:
        """The FULL verdict the gateway holds for the call's model and class, while it is fresh."""
        return self.queue.held_full(call.model, call.priority)

    def place(self, call: Judged, arrived_at: float | None = None) -> QueueFull | Placed:
        """The call's place in its model's queue (:meth:`AdmissionQueue.place`), with the time it
        has left (its deadline and the door's bound count from ``arrived_at``; None: now)."""
        waited = 0.0 if arrived_at is None else max(0.0, time.monotonic() - arrived_at)
        return self.queue.place(call.model, call.priority, call.timeout_s - waited, waited)

    def judged(self, request: Peeked) -> Judged | None:
        """The call's model, class and timeout, when they can be told from its bytes and the caches."""
        if "idempotency-key" in request.headers:
            return None
        try:
            body = strict_json.loads(request.body.decode("utf-8"))
        except (ValueError, RecursionError):  # not JSON (NaN, 1e400 too), or nested too deep: its 400 comes later
            return None
        if not isinstance(body, dict):
            return None
        native = request.path == "/v1/infer"
        model = body.get("model", self.default_model if native else None)
        timeout_ms = body.get("timeout_ms")
        if not isinstance(model, str):
            return None
        if self.keys:
            key = bearer_token(request.headers.get("authorization", ""))
            known = None if key is None else self.tenants.cached_priority(key, "")
        else:
            header = request.headers.get("x-tenant")
            tenant = named_tenant(body, header) if native else header or "default"
            known = self.tenants.cached_priority(None, tenant) if isinstance(tenant, str) else None
        if known is None:
            return None
        asked = Priority.OFFLINE if asks_offline(body, openai=not native) else Priority.INTERACTIVE
        if timeout_ms is None:
            timeout_s = self.default_timeout_s
        elif isinstance(timeout_ms, (int, float)) and not isinstance(timeout_ms, bool) \
                and 0 < timeout_ms <= self.max_timeout_ms:
            timeout_s = timeout_ms / 1000
        else:
            return None  # its 400 comes the usual way
        return Judged(model, priority_class(asked, known), timeout_s)
