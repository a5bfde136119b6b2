"""The door at accept: while the process is behind, or a FULL verdict is fresh, an inference request is refused
from its bytes already arrived, before gunicorn parses it or a greenlet is spawned for it."""
from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from tasks.config import Settings
from tasks.errors import QueueFull
from tasks.policy.shedding import Door
from tasks.schema import Priority
from webapp.door import refusal
from webapp.peek import Peeked, peek_request, tenant_of
from webapp.validation import asks_offline, bearer_token, named_tenant, priority_class

if TYPE_CHECKING:
    from tasks.gateway.gateway import Gateway
    from tasks.store.directory import TenantDirectory


class AcceptDoor:
    """The door at accept: while the process is behind, a request is refused from its bytes already arrived,
    before gunicorn parses it or a greenlet is spawned for it.

    Under a flood the refusals are most of the work: at three times the capacity of one 250 ms device, two
    API processes refuse 800 requests a second, and gunicorn's parsing, the WSGI environ and the response cost
    about half a millisecond each, enough with the admitted calls to keep the processes behind, and then everything is
    refused, the admitted calls' own round trips waiting behind the refusals. Here a refusal is a peek at the
    socket, a few header lookups, one write and a close. Anything this does not handle plainly (a request not
    all arrived yet, no Content-Length, chunked, not an inference call) goes the usual way, to be refused or let
    in by :class:`DoorMiddleware` with the same rules."""

    def __init__(self, door: Door, is_inference: Callable[[str], bool], held: HeldFull | None = None) -> None:
        self.door = door
        self.is_inference = is_inference
        self.held = held

    def __call__(self, sock: socket.socket, delay: float | None = None) -> bool:
        """Refuse the request on this connection if the door would (by its ``delay`` so far, or by the delay
        expected now), or the gateway would for want of room (True: answered; the caller closes the connection)."""
        behind = self.door.behind_at_accept(delay)
        if not behind and (self.held is None or not self.held.any()):
            return False
        request = peek_request(sock)
        if request is None or not self.is_inference(request.path):
            return False
        caller = request.headers.get("authorization") or request.headers.get("x-tenant") or tenant_of(request.body)
        # a light caller is not held to a flood's FULL verdict (the gateway lets it past: it is served fairly)
        light = self.door.callers.light(caller)
        error: QueueFull | None = None if self.held is None or light else self.held.refusal(request)
        if error is not None:
            self.door.callers.arrived(caller)  # counted as if it had entered, as the gateway's refusal would be
        elif behind:
            error = self.door.refusal_at_accept(caller, delay)
        if error is None:
            return False
        headers, body = refusal(error, request.path, request.headers.get("x-request-id"))
        head = "".join(f"{k}: {v}\r\n" for k, v in [*headers, ("Connection", "close")])
        try:
            sock.settimeout(0.0)
            sock.recv(request.size)  # all there: the peek saw it
            sock.sendall(f"HTTP/1.1 {error.status} Too Many Requests\r\n{head}\r\n".encode("latin-1") + body)
        except OSError:
            pass  # the caller is gone, or the response did not fit at once: it is closed all the same
        return True


class HeldFull:
    """The gateway's fresh FULL verdicts (:meth:`tasks.gateway.gateway.Gateway.held_full`), applied at accept.

    Under a flood most calls are refused for want of room, and for a few milliseconds after each such verdict the
    gateway refuses every call of that model and class with it, after gunicorn, Flask, authentication and the
    body's parsing have run (about half a millisecond each). Here the same refusal goes out from the request's
    bytes when the door can tell its model and class without I/O: the model from the body (or the default), the
    class from the body and the caller's tenant as the caches know it. A caller they do not know yet (a key not
    looked up, a tenant not seen), a body that is not a small JSON object, or a retry with an Idempotency-Key
    (it may be answered from its first call) goes the usual way."""

    def __init__(self, gateway: Gateway, tenants: TenantDirectory, settings: Settings) -> None:
        self.gateway = gateway
        self.tenants = tenants
        self.default_model = settings.models.default_model
        self.keys = settings.tenants.auth != "none"

    def any(self) -> bool:
        return self.gateway.holds_full()

    def refusal(self, request: Peeked) -> QueueFull | None:
        if "idempotency-key" in request.headers:
            return None
        try:
            body = json.loads(request.body)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: its 400 comes later
            return None
        if not isinstance(body, dict):
            return None
        native = request.path == "/v1/infer"
        model = body.get("model", self.default_model if native else None)
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
        return self.gateway.held_full(model, priority_class(asked, known))


