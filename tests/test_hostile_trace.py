"""Hostile callers against tracing: any caller can send a ``traceparent`` whose sampled flag is set, so the flag is
honoured only for an authenticated tenant, or up to a per-process rate (:class:`tasks.tracing.CallerFlags`); an
anonymous flood exports at most that rate of spans, and a tenant's sampled call is still exported beside it."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from tasks import tracing
from tasks.config import Settings
from tasks.store.models import ApiKeyRecord, Base, TenantRecord, make_engine
from tests.fakes import FakeClock
from webapp import create_app
from webapp.services import services

FLOOD = 1000


def forced(chosen: bool = False) -> str:
    """A traceparent asking to be sampled (``chosen``: a trace id whose low 64 bits are 0, which any ratio sampler
    takes when it reads the caller's trace id)."""
    trace_id = uuid.uuid4().hex[:16] + "0" * 16 if chosen else uuid.uuid4().hex
    return f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[InMemorySpanExporter, FakeClock]]:
    """This process traced to memory, under a ratio sampler sampling no trace of its own, callers' flags honoured
    at 3 a second (on a clock the test moves)."""
    clock = FakeClock()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing.sampler(ParentBased(TraceIdRatioBased(0.0)),
                                                      tracing.CallerFlags(3.0, clock)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter, clock
    provider.shutdown()


def call(parent: str, authenticated: bool = False) -> None:
    tracing.end(tracing.start("llmb.call", parent, server=True, at=time.time(),
                              attributes={tracing.AUTHENTICATED: authenticated}), time.time())


def test_the_bucket_refills_at_its_rate_and_holds_a_seconds_worth() -> None:
    clock = FakeClock()
    flags = tracing.CallerFlags(3.0, clock)
    assert [flags.honoured(False) for _ in range(5)] == [True] * 3 + [False] * 2
    clock.advance(0.34)
    assert flags.honoured(False) and not flags.honoured(False)
    clock.advance(3600)  # idle for an hour: still one second's worth
    assert sum(flags.honoured(False) for _ in range(10)) == 3
    assert all(flags.honoured(True) for _ in range(100))  # a tenant's takes no token
    assert not tracing.CallerFlags(0.0, clock).honoured(False)
    strict = tracing.CallerFlags(1.0, clock, trust_tenants=False)
    assert strict.honoured(True) and not strict.honoured(True)


def test_an_anonymous_flood_of_forced_flags_exports_at_most_the_rate(
        exported: tuple[InMemorySpanExporter, FakeClock]) -> None:
    exporter, clock = exported
    for i in range(FLOOD):
        call(forced(chosen=i % 2 == 1))  # half with a trace id any ratio sampler would take
        if i == FLOOD // 2:
            clock.advance(1.0)
    assert len(exporter.get_finished_spans()) == 3 + 3  # two seconds' worth, of a thousand calls
    call(forced(), authenticated=True)  # a tenant's sampled call, beside the flood: exported
    assert len(exporter.get_finished_spans()) == 7
    call(f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-00", authenticated=True)  # an unsampled one: not
    call(forced().replace("-01", "-00"))
    assert len(exporter.get_finished_spans()) == 7


def test_a_refused_flag_is_sampled_as_a_call_without_one_on_a_trace_id_the_caller_did_not_choose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing.sampler(ParentBased(TraceIdRatioBased(0.5)),
                                                      tracing.CallerFlags(0.0, FakeClock())))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    for _ in range(FLOOD):
        call(forced(chosen=True))
    assert 350 < len(exporter.get_finished_spans()) < 650  # about half, as the ratio says; not all


def test_batcher_and_worker_spans_of_a_sampled_call_are_not_capped(
        exported: tuple[InMemorySpanExporter, FakeClock]) -> None:
    exporter, _ = exported
    for _ in range(20):  # internal spans whose parent came in a message: the call was sampled already
        tracing.record("llmb.queued", forced(), 1.0, 2.0)
    assert len(exporter.get_finished_spans()) == 20


def test_over_http_anonymous_forced_calls_export_the_rate_and_a_tenants_call_is_exported(
        exported: tuple[InMemorySpanExporter, FakeClock], tmp_path: Path) -> None:
    exporter, _ = exported
    database_url = f"sqlite:///{tmp_path / 'keys.db'}"
    Base.metadata.create_all(make_engine(database_url), tables=[TenantRecord.__table__, ApiKeyRecord.__table__])  # type: ignore[list-item]
    app = create_app(Settings.from_env(overrides={"auth": "keys", "namespace": f"tr{time.monotonic_ns()}",
                                                  "database_url": database_url, "web_workers": 1}))
    _, key = services(app).keys.create_key("team-a")
    client = app.test_client()
    statuses = {client.post("/v1/infer", json={"model": "sim", "input": "x"},
                            headers={"traceparent": forced(chosen=True), "Authorization": f"Bearer sk-{i}"}).status_code
                for i in range(200)}  # random keys, each answered 401
    assert statuses == {401}, statuses
    assert len([s for s in exporter.get_finished_spans() if s.name == "llmb.call"]) == 3
    parent = forced()
    answer = client.post("/v1/infer", json={"model": "sim", "input": "x", "timeout_ms": 200},
                         headers={"traceparent": parent, "Authorization": f"Bearer {key}"})
    assert answer.status_code != 401
    ours = [s for s in exporter.get_finished_spans() if s.name == "llmb.call" and
            s.context is not None and f"{s.context.trace_id:032x}" == parent.split("-")[1]]
    assert len(ours) == 1 and ours[0].attributes is not None and ours[0].attributes[tracing.AUTHENTICATED] is True
