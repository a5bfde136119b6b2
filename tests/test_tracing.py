"""OpenTelemetry traces across the real processes: an API process, a batcher and two workers export their spans
over OTLP/HTTP (the standard OTEL_* variables) to a receiver this test runs, and one call's spans share its
trace id, nest in order under the caller's traceparent, and link to the batch that carried it."""
from __future__ import annotations

import gzip
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from sqlalchemy import select
from sqlalchemy.orm import Session

from harness.stack import Stack, free_port, running_stack, wait_for
from tasks import tracing
from tasks.store.models import RequestRecord, make_engine


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int  # ns
    end: int
    links: list[tuple[str, str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)


class Receiver:
    """An OTLP/HTTP trace receiver: what a collector does with ``POST /v1/traces``, keeping the spans."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, export: ExportTraceServiceRequest) -> None:
        for resource_spans in export.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    span = Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                s.start_time_unix_nano, s.end_time_unix_nano,
                                [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                                [e.name for e in s.events],
                                {a.key: a.value for a in s.attributes})
                    with self.lock:
                        self.spans.append(span)

    def of(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def traced(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with pytest.MonkeyPatch.context() as env:  # the standard variables, read by every process the stack starts
        env.setenv("OTEL_TRACES_EXPORTER", "otlp")
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        with running_stack(Path(tmp_path_factory.mktemp("traced")), workers=[0, (1, {"backend": "sim-lm"})],
                           web_workers=1, log_json="true") as s:
            yield s


def caller(sampled: bool = True) -> tuple[str, str, str]:
    """A caller's own trace: (trace id, span id, traceparent)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def test_a_calls_spans_from_every_process_share_its_trace_and_nest_in_order(traced: Stack,
                                                                           receiver: Receiver) -> None:
    trace_id, span_id, parent = caller()
    with requests.Session() as http:
        r = http.post(traced.url + "/v1/infer", json={"inputs": ["a", "b", "c"]}, headers={"traceparent": parent},
                      timeout=30)
    assert r.status_code == 200
    wanted = {"llmb.call", "llmb.admit", "llmb.wait", "llmb.queued", "llmb.buffered", "llmb.run", "llmb.write"}
    wait_for(lambda: wanted <= {s.name for s in receiver.of(trace_id)}, 20, "every process's spans of the call")
    spans = receiver.of(trace_id)
    (call,) = named(spans, "llmb.call")
    assert call.service == "llmb-api" and call.parent_id == span_id  # the caller's traceparent is the parent
    assert {s.service for s in spans} == {"llmb-api", "llmb-batcher", "llmb-worker"}
    for s in spans:
        if s is not call:
            assert s.parent_id == call.span_id, f"{s.name} is not a child of the call's span"
            assert call.start <= s.start <= s.end <= call.end, f"{s.name} lies outside the call"
    per_item = {name: sorted(named(spans, name), key=lambda s: s.start)
                for name in ("llmb.queued", "llmb.buffered", "llmb.run", "llmb.write")}
    assert all(len(v) == 3 for v in per_item.values())  # one per item of the call
    for queued, buffered, run, write in zip(*per_item.values()):
        assert queued.end <= buffered.start + 1_000_000 and buffered.end <= run.start + 1_000_000
        assert run.end <= write.start + 1_000_000  # queued, buffered, run, written, in that order (1 ms slack)

    # the batch: a span of its own trace, linked to every member; the worker's batch spans are its children
    batch_span_ids = {link for run in per_item["llmb.run"] for link in run.links}
    assert len(batch_span_ids) >= 1
    with receiver.lock:
        batches = [s for s in receiver.spans if s.name == "llmb.batch" and (s.trace_id, s.span_id) in batch_span_ids]
    assert batches, "the llmb.batch span the items link to"
    for batch in batches:
        assert batch.service == "llmb-batcher" and batch.parent_id == ""
        assert (trace_id, call.span_id) in batch.links and len(set(batch.links)) == len(batch.links)  # per call
        assert len(batch.links) <= batch.attributes["llmb.batch.size"].int_value
        wait_for(lambda b=batch: {"llmb.batch.run", "llmb.batch.write"} <= {
            s.name for s in receiver.of(b.trace_id) if s.parent_id == b.span_id}, 20, "the worker's batch spans")

    # the ledger and the JSON logs carry the trace id
    with Session(make_engine(traced.database_url)) as db:
        def rows() -> list[RequestRecord]:
            return list(db.scalars(select(RequestRecord).where(RequestRecord.correlation_id == r.headers[
                "X-Request-Id"]).execution_options(populate_existing=True)))
        wait_for(lambda: len(rows()) == 3 and all(row.trace_id == trace_id for row in rows()), 20,
                 "the ledger's rows with the trace id")
    log = (traced.tmp / "web.log").read_text()
    assert f'"trace_id": "{trace_id}"' in log


def test_a_stream_marks_its_first_token_and_a_call_without_a_traceparent_starts_a_trace(
        traced: Stack, receiver: Receiver) -> None:
    trace_id, _, parent = caller()
    body: dict[str, Any] = {"model": "sim-lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                            "stream": True}
    with requests.Session() as http:
        with http.post(traced.url + "/v1/chat/completions", json=body, headers={"traceparent": parent},
                       stream=True, timeout=30) as r:
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        plain = http.post(traced.url + "/v1/infer", json={"input": "untraced caller"}, timeout=30)
    wait_for(lambda: any(s.name == "llmb.wait" for s in receiver.of(trace_id)), 20, "the stream's wait span")
    wait_for(lambda: any(s.name == "llmb.call" for s in receiver.of(trace_id)), 20, "the stream's call span")
    (wait,) = named(receiver.of(trace_id), "llmb.wait")
    (call,) = named(receiver.of(trace_id), "llmb.call")
    assert "first_token" in wait.events and call.start <= wait.start <= wait.end <= call.end  # ends with the stream
    assert plain.status_code == 200
    wait_for(lambda: any(s.name == "llmb.call" and s.parent_id == "" and s.attributes["llmb.request_id"].string_value
                         == plain.headers["X-Request-Id"] for s in list(receiver.spans)), 20, "a new trace's root")


def test_an_unsampled_caller_sends_nothing(traced: Stack, receiver: Receiver) -> None:
    quiet, _, unsampled = caller(sampled=False)
    loud, _, sampled = caller()
    with requests.Session() as http:
        assert http.post(traced.url + "/v1/infer", json={"input": "quiet"}, headers={"traceparent": unsampled},
                         timeout=30).status_code == 200
        assert http.post(traced.url + "/v1/infer", json={"input": "loud"}, headers={"traceparent": sampled},
                         timeout=30).status_code == 200
    # the sampled call's spans came from every process after the unsampled one's would have
    wait_for(lambda: {"llmb.call", "llmb.run"} <= {s.name for s in receiver.of(loud)}, 20, "the sampled call")
    assert receiver.of(quiet) == []


def test_traceparents_are_read_and_written_as_w3c_says() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.trace_id(parent) == "0af7651916cd43dd8448eb211c80319c" and tracing.sampled(parent)
    assert not tracing.sampled(parent[:-2] + "00") and not tracing.sampled("junk") and tracing.trace_id(None) is None
    assert tracing.context_of("00-zz-zz-01") is None and tracing.context_of(None) is None


def test_a_batch_of_a_sampled_call_is_sampled_whatever_the_ratio() -> None:
    from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased
    from opentelemetry.trace import Link, SpanContext, TraceFlags

    sampler = tracing._BatchesOfSampledCalls(TraceIdRatioBased(0.0))  # samples no trace of its own
    member = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    unsampled = SpanContext(member.trace_id, member.span_id, is_remote=True, trace_flags=TraceFlags(0))
    assert sampler.should_sample(None, 1, "llmb.batch", links=[Link(member)]).decision == Decision.RECORD_AND_SAMPLE
    assert sampler.should_sample(None, 1, "llmb.batch", links=[Link(unsampled)]).decision == Decision.DROP
    assert sampler.should_sample(None, 1, "llmb.call").decision == Decision.DROP
