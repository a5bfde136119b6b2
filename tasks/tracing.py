"""OpenTelemetry traces of each call's way through the processes: off unless ``OTEL_TRACES_EXPORTER`` names an
exporter.

A call crosses an API process, RabbitMQ, a batcher, a worker and Redis, and shares its batch with up to 99
others, so the spans are:

- API process: ``llmb.call`` (a server span, the child of the caller's W3C ``traceparent`` if it sent one), with
  ``llmb.admit`` (its turn at the door, admission and the publish) and ``llmb.wait`` (until its results are read;
  a stream's first token and end are events on it);
- batcher: per item ``llmb.queued`` (from its admission until the batcher took its message) and ``llmb.buffered``
  (until its batch was handed to a worker), children of its call; and one ``llmb.batch`` per batch, in a trace of
  its own (a batch has many parents), with a link to each member call's span;
- worker: per batch ``llmb.batch.run`` (the device run) and ``llmb.batch.write`` (results written), children of
  ``llmb.batch``; per item ``llmb.run`` and ``llmb.write`` with the same times, children of its call and linked
  to the batch, so one request's trace holds every hop.

The call's context travels in the request message and each batch item (``trace``), the batch's in the batch
message. Configuration is the SDK's standard variables: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``,
``none``: the default), ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (OTLP over
HTTP), ``OTEL_TRACES_SAMPLER`` and its argument (``parentbased_always_on`` by default: a caller's sampled flag
is honoured, as far as :class:`CallerFlags` allows), ``OTEL_SERVICE_NAME`` (by default ``llmb-api``,
``llmb-batcher``, ``llmb-worker``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*``. Off, every function here
returns at its first line: nothing is imported from the SDK and nothing is allocated per call.
"""
from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tasks.config import Settings
from tasks.schema import Batch, BatchItem

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: Tracer | None = None
AUTHENTICATED = "llmb.authenticated"  # an ``llmb.call`` span's attribute: its caller showed a live key


class CallerFlags:
    """Whose sampled flag (a ``traceparent`` ending ``-01``) this process honours: an authenticated tenant's always
    (unless ``trust_tenants`` is off), anyone else's at most ``per_s`` a second (a token bucket holding one
    second's worth, at least one). Any caller can send the flag, so without this an anonymous flood forces every
    one of its calls into the export queue, crowding out every other tenant's spans."""

    def __init__(self, per_s: float, clock: Callable[[], float], *, trust_tenants: bool = True) -> None:
        self.per_s = max(0.0, per_s)
        self.burst = max(1.0, self.per_s)
        self.trust_tenants = trust_tenants
        self._clock = clock
        self._tokens = self.burst if self.per_s > 0 else 0.0
        self._at = clock()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, clock: Callable[[], float]) -> CallerFlags:
        return cls(settings.web.trace_parent_max_per_s, clock, trust_tenants=settings.web.trace_parent_tenants)

    def honoured(self, authenticated: bool) -> bool:
        """Whether this call's sampled flag counts (a refused one costs nothing: it takes no token)."""
        if authenticated and self.trust_tenants:
            return True
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.per_s)
            self._at = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


def setup(service: str, callers: CallerFlags | None = None) -> None:
    """Start tracing in this process if ``OTEL_TRACES_EXPORTER`` asks for it (call once, after any fork);
    ``callers``: how far the server spans' callers' sampled flags are honoured (the API process's)."""
    global _tracer
    if _tracer is not None:
        return
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    if not names or names == ["none"] or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service)}),
                              sampler=sampler(_env_sampler(), callers))
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif name == "console":
            exporter = ConsoleSpanExporter()
        else:  # a typo must not keep the service from starting: it runs untraced by that exporter, and says so
            log.error("OTEL_TRACES_EXPORTER: unknown exporter %r (otlp, console or none): ignored", name)
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = provider.get_tracer("llm-batcher")


def _env_sampler() -> Sampler:
    """The sampler ``OTEL_TRACES_SAMPLER`` (and its argument) names, as the SDK reads them."""
    from opentelemetry.sdk.trace import sampling

    return sampling._get_from_env_or_default()


def sampler(configured: Sampler, callers: CallerFlags | None) -> Sampler:
    """The process's sampler: the configured one, its callers' flags capped, batches of sampled calls sampled."""
    return _BatchesOfSampledCalls(configured if callers is None else _CallersFlagsCapped(configured, callers))


class _CallersFlagsCapped(Sampler):
    """The configured sampler, but a server span whose caller's sampled flag :class:`CallerFlags` refuses is
    decided as a call without a traceparent is, on a random trace id (not the caller's: a ratio sampler reads the
    trace id, which the caller chose)."""

    def __init__(self, inner: Sampler, callers: CallerFlags) -> None:
        self.inner = inner
        self.callers = callers

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str, kind: SpanKind | None = None,
                      attributes: Any = None, links: Sequence[Link] | None = None,
                      trace_state: Any = None) -> SamplingResult:
        if kind == SpanKind.SERVER and parent_context is not None:
            parent = trace.get_current_span(parent_context).get_span_context()
            if parent.is_valid and parent.is_remote and parent.trace_flags.sampled and not self.callers.honoured(
                    bool((attributes or {}).get(AUTHENTICATED))):
                return self.inner.should_sample(None, random.getrandbits(128), name, kind, attributes, links,
                                                trace_state)
        return self.inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"CallersFlagsCapped({self.inner.get_description()})"


class _BatchesOfSampledCalls(Sampler):
    """The configured sampler, but for a batch's span: a batch is sampled when one of its calls is (it is the root
    of its own trace, so a ratio sampler would otherwise drop most batches of sampled calls)."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str, kind: SpanKind | None = None,
                      attributes: Any = None, links: Sequence[Link] | None = None,
                      trace_state: Any = None) -> SamplingResult:
        if name == "llmb.batch" and any(link.context.trace_flags.sampled for link in links or ()):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self.inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"BatchesOfSampledCalls({self.inner.get_description()})"


def enabled() -> bool:
    return _tracer is not None


def context_of(traceparent: str | None) -> Context | None:
    """The context a W3C ``traceparent`` names (None: none, or not one)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(span: Span) -> str | None:
    """The W3C ``traceparent`` of a span, to carry in a message (None: the span is not valid)."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def trace_id(traceparent: str | None) -> str | None:
    """The trace id (32 hex digits) a ``traceparent`` names, for logs and the ledger (None: none)."""
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def sampled(traceparent: str | None) -> bool:
    """Whether a ``traceparent`` says its trace is sampled (spans of an unsampled one are not sent)."""
    parts = (traceparent or "").split("-")
    try:
        return len(parts) == 4 and bool(int(parts[3], 16) & 1)
    except ValueError:
        return False


def start(name: str, parent: str | None = None, *, at: float, server: bool = False,
          attributes: dict[str, Any] | None = None) -> Span | None:
    """Start a span at ``at`` (epoch seconds, on the fleet's shared clock, as every span's times are) that
    :func:`end` ends (not made current: a call's spans are parented explicitly, by the traceparents its messages
    carry; ``server``: the span of an HTTP request). None when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=context_of(parent), kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                              attributes=attributes, start_time=int(at * 1e9))


def event(span: Span | None, name: str) -> None:
    if span is not None:
        span.add_event(name)


def fail(span: Span, why: str) -> None:
    span.set_status(Status(StatusCode.ERROR, why))


def end(span: Span | None, at: float, error: BaseException | None = None) -> None:
    """End a span at ``at`` (epoch seconds, shared clock), as failed if ``error``."""
    if span is None:
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        status = getattr(error, "status", None)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
    span.end(end_time=int(at * 1e9))


def record(name: str, parent: str | None, start: float, end: float, *, attributes: dict[str, Any] | None = None,
           links: Sequence[str | None] = ()) -> str | None:
    """A span that already happened, from ``start`` to ``end`` (epoch seconds), child of ``parent``; returns its
    traceparent (None when tracing is off, or the parent was not sampled)."""
    if _tracer is None:
        return None
    done = _tracer.start_span(name, context=context_of(parent), attributes=attributes, links=_links(links),
                              start_time=int(start * 1e9))
    done.end(end_time=int(max(start, end) * 1e9))
    return traceparent_of(done) if done.get_span_context().trace_flags.sampled else None


def _links(traceparents: Sequence[str | None]) -> list[Link]:
    out = []
    for parent in traceparents:
        ctx = context_of(parent)
        if ctx is not None:
            context: SpanContext = trace.get_current_span(ctx).get_span_context()
            out.append(Link(context))
    return out


def stamp_batch(batch: Batch, received: list[float], now: float) -> Batch:
    """The batcher's spans for a batch about to be sent at ``now`` (``received``: when each item reached the
    batcher; epoch seconds, shared clock): ``llmb.queued`` and ``llmb.buffered`` per sampled item, ``llmb.batch``
    linked to each of their calls; the batch carries its traceparent to the worker. A batch of unsampled items
    gets nothing."""
    members = list(dict.fromkeys(item.trace for item in batch.items if sampled(item.trace)))  # one per call
    if not members:
        return batch
    for item, got in zip(batch.items, received):
        if sampled(item.trace):
            record("llmb.queued", item.trace, item.accepted_at, got, attributes={"llmb.tenant": item.tenant})
            record("llmb.buffered", item.trace, got, now, attributes={"llmb.batch.id": batch.id})
    parent = record("llmb.batch", None, now, now, links=members, attributes={
        "llmb.batch.id": batch.id, "llmb.batch.size": len(batch.items), "llmb.model": batch.model})
    return replace(batch, trace=parent)


def run_spans(batch: Batch, items: Sequence[BatchItem], worker: str, started: float, ran: float,
              written: float) -> None:
    """The worker's spans for a batch it ran from ``started`` to ``ran`` and whose results it wrote by
    ``written`` (epoch): ``llmb.batch.run`` and ``llmb.batch.write`` under the batch's span, and per sampled
    item ``llmb.run`` and ``llmb.write`` under its call, linked to the batch."""
    if _tracer is None or not sampled(batch.trace):
        return
    attributes = {"llmb.batch.id": batch.id, "llmb.batch.size": len(items), "llmb.worker": worker}
    record("llmb.batch.run", batch.trace, started, ran, attributes=attributes)
    record("llmb.batch.write", batch.trace, ran, written, attributes=attributes)
    for item in items:
        if sampled(item.trace):
            record("llmb.run", item.trace, started, ran, attributes=attributes, links=[batch.trace])
            record("llmb.write", item.trace, ran, written, attributes=attributes)
