"""The Responses API, as OpenAI's, over the chat path.

    POST /v1/responses   GET /v1/responses/ID (?stream=true&starting_after=N)   DELETE /v1/responses/ID
    GET /v1/responses/ID/input_items   POST /v1/responses/ID/cancel

A response is a chat call (:mod:`webapp.responses_schema` translates the body; the chat route's parser checks it),
through the same gateway, admission and batching as any other. ``store`` (the default) keeps it in the SQL store
for its tenant (:mod:`tasks.store.responses`), where ``previous_response_id`` finds the conversation it continues;
another tenant's response is a 404. ``stream`` sends the Responses events (:mod:`webapp.responses_stream`).

``background`` answers at once (``queued``) with the call admitted and published at offline priority, with the
longest offline deadline: the call runs on the workers whatever becomes of this API process, its result and its
streamed pieces are in Redis (the journal), and any API process finishes the stored response from them when it is
read (``GET``), or resumes its event stream. A thread of the process that took it follows it and stores its end
as soon as it comes. ``cancel`` stops the generation when the process that took the call still follows it; on
another process it marks the response cancelled and the call's answer is dropped.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from sqlalchemy.exc import SQLAlchemyError

from tasks.errors import BatchingError, InvalidInput, NotFound, NotResumable, Unavailable
from tasks.gateway.calls import Call, Events
from tasks.schema import Priority
from tasks.state.records import Shape
from tasks.store.responses import ResponseStore, Stored
from webapp import sse, tenancy
from webapp.adapter_names import resolved
from webapp.body import read_json
from webapp.errors import OPENAI, exception_response, register_error_handlers
from webapp.openai_api import _check_model, _run
from webapp.openai_schema import parse_chat
from webapp.openai_tools import calls_tools
from webapp.responses_schema import chat_body, check_fields, in_our_terms, input_items, new_response_id, response_object
from webapp.responses_stream import as_sse, error_of, events, stored_events
from webapp.services import services
from webapp.validation import asks_offline

log = logging.getLogger("llmb.web")
bp = Blueprint("responses", __name__)
register_error_handlers(bp, OPENAI)
STORE = "llmb.responses"  # app.extensions key of the store
LOST_AFTER_S = 30.0  # a response not final whose call Redis does not know this long after its creation was lost
CANCELLED: dict[str, threading.Event] = {}  # background responses this process follows -> their cancel flag


@bp.errorhandler(SQLAlchemyError)
def _database_down(exc: SQLAlchemyError) -> Response:
    return exception_response(Unavailable(f"the database is unreachable: {type(exc).__name__}"), OPENAI)


def _store() -> ResponseStore:
    """This process's response store, built at the first call (on the key store's engine: one pool)."""
    found = current_app.extensions.get(STORE)
    if found is None:
        s = services()
        found = current_app.extensions[STORE] = ResponseStore.from_settings(s.settings, s.keys.engine, s.clock)
    assert isinstance(found, ResponseStore)
    return found


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"no response {response_id!r} of this tenant (stored responses expire after "
                    f"{services().settings.stores.responses_expire_s} s)")


@bp.post("/v1/responses")
@tenancy.authenticated
def create() -> Response:
    settings = services().settings
    body = check_fields(read_json(settings))
    tenant, store, now = tenancy.tenant_name(), _store(), time.time()
    response_id = new_response_id(now)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        found = store.get(tenant, previous)
        if found is None:
            raise NotFound(f"'previous_response_id': no stored response {previous!r} of this tenant")
        if not found.final:
            raise InvalidInput(f"'previous_response_id': response {previous!r} is still {found.status}")
        history = found.conversation()
    items = input_items(body.get("input"), response_id)
    chat = chat_body(body, [*history, *items])
    background, kept = bool(body.get("background")), body.get("store", True)
    if background:
        chat["priority"] = Priority.OFFLINE.value
        chat.setdefault("timeout_ms", settings.admission.offline_max_timeout_ms)
    if kept:
        store.check_room(tenant)
    try:
        call, _ = parse_chat(chat, settings, g.request_id, g.claimed_tenant or "default")
    except InvalidInput as exc:
        raise in_our_terms(exc) from None
    priority = Priority.OFFLINE if asks_offline(chat, openai=True) else Priority.INTERACTIVE
    call = resolved(tenancy.bind_caller(replace(call, priority=priority), claimed_tenant=g.claimed_tenant))
    request_body = {k: v for k, v in body.items() if k != "input"}
    if background:
        return _background(call, tenant, response_id, request_body, items, history, now)
    if body.get("stream"):
        return _stream(call, tenant, response_id, request_body, items, history, now, kept)
    answer = _run(call, "chat", Shape("chat", tool_calls=calls_tools(call.params)))
    final = response_object(response_id, request_body, now, "completed", answer.results[0])
    if kept:
        store.save(tenant, call.request_id, final, request_body, items, history)
    return jsonify(final)


def _stream(call: Call, tenant: str, response_id: str, request_body: dict[str, Any], items: list[dict[str, Any]],
            history: list[dict[str, Any]], now: float, kept: bool) -> Response:
    """A streamed response; stored (running, then as it ended) when ``kept``."""
    _check_model(call, "chat")
    calls = services().gateway.stream(call, shape=Shape("chat", stream=True, tool_calls=calls_tools(call.params)))
    store = _store()
    if kept:
        store.save(tenant, call.request_id, response_object(response_id, request_body, now, "in_progress"),
                   request_body, items, history)

    def ended(final: dict[str, Any]) -> None:
        if kept:
            store.finish(tenant, response_id, final)

    def generate() -> Iterator[str]:
        try:
            for event in events(response_id, request_body, now, calls, on_end=ended):
                yield as_sse(event)
        finally:
            calls.close()  # the client went away mid-stream: cancel the generation (unless it resumes)

    return sse.response(generate())


def _background(call: Call, tenant: str, response_id: str, request_body: dict[str, Any],
                items: list[dict[str, Any]], history: list[dict[str, Any]], now: float) -> Response:
    """Store the response queued, admit and publish its call, follow it in a thread; answer at once."""
    store = _store()
    queued = response_object(response_id, request_body, now, "queued")
    stored = store.save(tenant, call.request_id, queued, request_body, items, history)
    try:
        _check_model(call, "chat")
        calls = services().gateway.stream(call, shape=Shape("chat", stream=True, tool_calls=calls_tools(call.params)))
    except BaseException:
        store.delete(tenant, response_id)  # refused (429, 400...): nothing runs, nothing is kept
        raise
    cancelled = CANCELLED[response_id] = threading.Event()
    threading.Thread(target=_follow, args=(store, tenant, response_id, request_body, now, calls, cancelled),
                     name=f"follow-{response_id}", daemon=True).start()
    if request_body.get("stream"):
        return _resumed(stored, -1)
    return jsonify(queued)


def _follow(store: ResponseStore, tenant: str, response_id: str, request_body: dict[str, Any], created: float,
            calls: Events, cancelled: threading.Event) -> None:
    """Run a background response's call to its end and store it (unless it was cancelled meanwhile)."""
    try:
        for event in events(response_id, request_body, created, calls,
                            on_end=lambda final: store.finish(tenant, response_id, final)):
            if cancelled.is_set():
                break
            if event["type"] == "response.created":
                store.finish(tenant, response_id, event["response"])  # in_progress, unless cancelled already
    except Exception:
        log.exception("background response %s: could not store its end (a GET finishes it from its result)",
                      response_id)
    finally:
        calls.close()
        CANCELLED.pop(response_id, None)


def _refreshed(stored: Stored) -> Stored:
    """A response not yet final, finished from its call's result if it has one (any API process can)."""
    if stored.final:
        return stored
    try:
        found = services().gateway.lookup(stored.tenant, stored.request_id)
    except BatchingError:
        return stored  # Redis away: as stored
    if found is None and time.time() - stored.created_at < LOST_AFTER_S:
        return stored  # its call not admitted yet (a background response is stored first)
    if found is None:
        final = response_object(stored.id, stored.request, stored.created_at, "failed",
                                error={"code": "server_error", "message": "the response's call was lost"})
    elif found.answer is not None:
        final = response_object(stored.id, stored.request, stored.created_at, "completed", found.answer.results[0])
    elif found.error is not None:
        final = response_object(stored.id, stored.request, stored.created_at, "failed", error=error_of(found.error))
    else:
        return stored
    return _store().finish(stored.tenant, stored.id, final) or stored


def _found(response_id: str) -> Stored:
    stored = _store().get(tenancy.tenant_name(), response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


@bp.get("/v1/responses/<response_id>")
@tenancy.authenticated
def retrieve(response_id: str) -> Response:
    stream = request.args.get("stream", "false")
    if stream not in ("true", "false"):
        raise InvalidInput("'stream' must be true or false")
    try:
        after = int(request.args.get("starting_after", "-1"))
    except ValueError:
        raise InvalidInput("'starting_after' must be an integer (a sequence_number)") from None
    stored = _found(response_id)
    if stream == "true":
        return _resumed(stored, after)
    return jsonify(_refreshed(stored).body)


def _resumed(stored: Stored, after: int) -> Response:
    """The response's events after sequence number ``after``: from its call's journal while Redis holds it,
    else from the stored response."""
    try:
        resumed = services().gateway.resume(stored.tenant, stored.request_id, None)
    except NotResumable:
        resumed = None
    if resumed is not None:
        store = _store()
        body = (events(stored.id, stored.request, stored.created_at, resumed.events, after,
                       on_end=lambda final: store.finish(stored.tenant, stored.id, final)))
    else:
        stored = _refreshed(stored)
        if not stored.final:
            raise NotResumable(f"response {stored.id!r} is {stored.status}; its stream cannot be read now")
        body = stored_events(stored.body, stored.request, after)
    return sse.response(as_sse(e) for e in body)


@bp.delete("/v1/responses/<response_id>")
@tenancy.authenticated
def delete(response_id: str) -> Response:
    if not _store().delete(tenancy.tenant_name(), response_id):
        raise _not_found(response_id)
    return jsonify(id=response_id, object="response", deleted=True)


@bp.get("/v1/responses/<response_id>/input_items")
@tenancy.authenticated
def list_input_items(response_id: str) -> Response:
    """The response's input items (newest first unless ``order=asc``, as OpenAI's), in pages of ``limit``."""
    stored = _found(response_id)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidInput("'order' must be 'asc' or 'desc'")
    try:
        limit = int(request.args.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidInput("'limit' must be an integer from 1 to 100")
    data = list(stored.input_items) if order == "asc" else list(reversed(stored.input_items))
    after = request.args.get("after")
    if after:
        ids = [item["id"] for item in data]
        data = data[ids.index(after) + 1:] if after in ids else []
    page = data[:limit]
    return jsonify(object="list", data=page, first_id=page[0]["id"] if page else None,
                   last_id=page[-1]["id"] if page else None, has_more=len(data) > limit)


@bp.post("/v1/responses/<response_id>/cancel")
@tenancy.authenticated
def cancel(response_id: str) -> Response:
    stored = _found(response_id)
    if not stored.request.get("background"):
        raise InvalidInput("only a background response can be cancelled")
    stored = _refreshed(stored)
    if not stored.final:
        flag = CANCELLED.get(response_id)
        if flag is not None:
            flag.set()
        cancelled = response_object(stored.id, stored.request, stored.created_at, "cancelled")
        stored = _store().finish(stored.tenant, stored.id, cancelled) or stored
    return jsonify(stored.body)
