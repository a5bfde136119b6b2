"""Flask app factory and routes.

    gunicorn -c webapp/gunicorn_conf.py 'webapp:create_app()'
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from collections.abc import Callable

from flask import Flask, Response, g, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tasks import tracing
from tasks.config import Settings
from tasks.errors import Unauthorized
from tasks.logs import setup_logging
from tasks.state.metrics import HTTP_REQUESTS, REQUEST_LATENCY, count_refusal
from tasks.state.records import Shape
from webapp import (
    adapters_api,
    admin_api,
    answers,
    batch_api,
    openai_api,
    openapi,
    requests_api,
    responses_api,
    tenancy,
    worker,
)
from webapp.accept_door import AcceptDoor, QueueShedding
from webapp.adapter_names import resolved
from webapp.body import read_json
from webapp.door import DoorMiddleware, door_identity
from webapp.errors import register_error_handlers
from webapp.services import EXTENSION, Services, services
from webapp.validation import parse_infer, request_id_from

log = logging.getLogger("llmb.web")
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    setup_logging(settings)
    tracing.setup("llmb-api", tracing.CallerFlags.from_settings(settings, time.monotonic))  # off unless OTEL_... asks
    app = Flask(__name__, static_folder=None)  # no static files: every route is an API route
    app.config["MAX_CONTENT_LENGTH"] = settings.admission.max_body_bytes
    built = Services.from_settings(settings)  # the process's one set of clients, for every route
    app.extensions[EXTENSION] = built
    identity = door_identity(settings, built.tenants)  # who the door counts a call as: its tenant
    app.wsgi_app = DoorMiddleware(app.wsgi_app, built.door, is_inference, identity)  # type: ignore[method-assign]
    # the same door, and the admission queue's view, before gunicorn parses a request (the worker finds them here)
    shedding = QueueShedding(built.queue, built.tenants, settings)
    built.arrivals.at_accept = AcceptDoor(built.door, is_inference, shedding, identity)
    app.extensions[worker.ARRIVALS] = built.arrivals

    @app.before_request
    def _correlate() -> None:
        g.request_id = request_id_from(request.headers.get("X-Request-Id"))
        g.started = request.environ.get("llmb.arrived_at") or time.monotonic()  # the accept, under a burst

    @app.after_request
    def _account(response: Response) -> Response:
        response.headers["X-Request-Id"] = g.get("request_id", "")
        if g.get("replayed"):  # an idempotent retry, answered with the first call's answer
            response.headers["Idempotent-Replayed"] = "true"
        if is_inference(request.path):
            log_outcome(response)
        return response

    if tracing.enabled():  # (off, a request runs no hook of it)
        trace_calls(app, built.clock)
    register_error_handlers(app)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(admin_api.bp)
    app.register_blueprint(adapters_api.bp)
    app.register_blueprint(requests_api.bp)
    app.register_blueprint(batch_api.bp)
    app.register_blueprint(responses_api.bp)
    app.add_url_rule("/v1/infer", view_func=infer, methods=["POST"])
    app.add_url_rule("/healthz", view_func=healthz)
    app.add_url_rule("/readyz", view_func=readyz)
    if not settings.web.metrics_bind:  # else gunicorn serves it there (webapp/gunicorn_conf.py), and here is a 404
        app.add_url_rule("/metrics", view_func=metrics)
    document = _document(settings)

    def openapi_json() -> Response:
        """The OpenAPI 3.1 document of every route (:mod:`webapp.openapi`); no key needed, as with /healthz."""
        return Response(document, mimetype="application/json")

    app.add_url_rule("/openapi.json", view_func=openapi_json)
    return app


def trace_calls(app: Flask, clock: Callable[[], float]) -> None:
    """Each inference call's ``llmb.call`` span, from its accept (the caller's traceparent its parent) to its
    answer's last byte (:mod:`tasks.tracing`)."""

    @app.before_request
    def _start_span() -> None:
        if is_inference(request.path):
            parent = request.headers.get("traceparent")
            attributes = {"http.request.method": request.method, "url.path": request.path,
                          "llmb.request_id": g.request_id}
            if tracing.sampled(parent):  # a flag any caller can send: the sampler weighs who sent it
                attributes[tracing.AUTHENTICATED] = _has_live_key()
            g.span = tracing.start("llmb.call", parent, server=True, attributes=attributes,
                                   at=clock() - (time.monotonic() - g.started))
            g.trace = tracing.traceparent_of(g.span) if g.span is not None else None

    @app.after_request
    def _status(response: Response) -> Response:
        span = g.get("span")
        if span is not None:
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                tracing.fail(span, f"HTTP {response.status_code}")
            if response.is_streamed:  # the view has returned; the stream (and its span) ends later
                g.pop("span")
                response.call_on_close(lambda: tracing.end(span, clock()))
        return response

    @app.teardown_request
    def _end_span(error: BaseException | None) -> None:
        tracing.end(g.pop("span", None), clock(), error)


def _has_live_key() -> bool:
    """Whether the call shows a live API key (asked before its span starts, only of a call whose traceparent asks
    to be sampled: its flag is honoured beyond the per-process rate only for a tenant, :class:`tracing.CallerFlags`);
    the key's lookup is cached, so the route's own authentication right after costs nothing more."""
    if services().settings.tenants.auth == "none":
        return False
    try:
        services().tenants.principal(tenancy.bearer_key())
    except Unauthorized:
        return False
    return True


def is_inference(path: str) -> bool:
    return path in ("/v1/infer", "/v1/responses") or path.startswith(OPENAI_PATHS)


def log_outcome(response: Response) -> None:
    """One structured line and one metrics update per inference call."""
    elapsed = time.monotonic() - g.get("started", time.monotonic())
    error_type = g.get("error_type", "")
    HTTP_REQUESTS.labels(str(response.status_code), error_type).inc()
    REQUEST_LATENCY.labels(str(response.status_code)).observe(elapsed)
    if response.status_code == 429:
        principal = g.get("principal")
        count_refusal(principal.tenant.name if principal is not None else g.get("claimed_tenant") or "default",
                      error_type)
    if not log.isEnabledFor(logging.INFO):  # its arguments alone cost a few percent of a request's CPU
        return
    batches = ",".join(g.get("batch_ids", ()))
    log.info("request %s -> %d%s in %.1f ms%s", g.get("request_id"), response.status_code,
             f" {error_type}" if error_type else "", elapsed * 1000, f" batch {batches}" if batches else "",
             extra={"request_id": g.get("request_id"), "status": response.status_code, "error": error_type or None,
                    "batch_id": batches or None, "total_ms": round(elapsed * 1000, 1),
                    **({"trace_id": tracing.trace_id(g.get("trace"))} if tracing.enabled() else {})})


@tenancy.authenticated
def infer() -> Response:
    settings = services().settings
    body = read_json(settings)
    call = parse_infer(body, settings, g.request_id, g.claimed_tenant)
    # without keys the body's "tenant" names the caller (over X-Tenant); with keys it must be the key's
    call = resolved(tenancy.bind_caller(call, claimed_tenant=body.get("tenant") or g.claimed_tenant))
    shape = Shape("infer", single="input" in body)
    answer = answers.noted(services().gateway.submit(call, shape=shape, idempotency=answers.idempotency(body)))
    g.batch_ids = list(dict.fromkeys(r.batch_id for r in answer.results))
    return jsonify(answers.render(shape, call.model, answer, started=g.started))


def healthz() -> Response:
    return jsonify(status="ok")


def readyz() -> Response:
    return jsonify(status="ready", **services().ping())


def _document(settings: Settings) -> bytes:
    """The OpenAPI document of this app's settings, as JSON (built once, in :func:`create_app`)."""
    try:
        version = importlib.metadata.version("llm-batcher")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = "0"
    return json.dumps(openapi.document(version, settings)).encode()


def metrics() -> Response:
    return Response(generate_latest(services().metrics), mimetype=CONTENT_TYPE_LATEST)
