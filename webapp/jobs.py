"""``llmb-jobs``: the process that runs the Batch API's jobs (:mod:`tasks.jobs.feeder` is its loop).

It is composed like an API process (:class:`webapp.services.Services`: the same gateway, key store and tenant
directory) and runs each line the way its endpoint's route would (:class:`LineRunner`: the same body checks,
:func:`webapp.body.parse_json`, so a body holding a lone surrogate is that line's 400 as the interactive call's
would be; the same parsing and the same response bodies), with these differences: the caller is the job's tenant,
every line is offline priority, a line that gives no ``timeout_ms`` gets ``LLMB_JOBS_LINE_TIMEOUT_MS``, and every
line carries an idempotency key derived from its job and ``custom_id``: a line sent again by the process that took
a killed one's job over gets that sending's answer (the gateway follows any sending that may have been published).

    llmb-jobs          # any number of them, on any hosts: each job is run by one at a time (a lease in SQL)
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace
from typing import Any

import click

from tasks.config import Settings
from tasks.errors import BatchingError, Forbidden, InvalidInput
from tasks.gateway.calls import Call
from tasks.jobs.feeder import Feeder
from tasks.jobs.job_run import LineResult
from tasks.logs import setup_logging
from tasks.policy.batchfile import idempotency_key
from tasks.policy.tenancy import Principal
from tasks.schema import Priority
from tasks.state.records import Idempotency, Shape
from tasks.store.files import FileStore
from tasks.store.jobs import JobInfo, JobStore, Line
from webapp.adapter_names import resolve, shown_model
from webapp.answers import render
from webapp.body import parse_json
from webapp.errors import NATIVE, OPENAI, status_of
from webapp.openai_api import KIND_FOR, check_model
from webapp.openai_schema import parse_chat, parse_completion, parse_embeddings
from webapp.services import Services
from webapp.validation import bind, parse_infer

log = logging.getLogger("llmb.jobs")

ROUTE = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/embeddings": "embeddings",
         "/v1/infer": "infer"}


class LineRunner:
    """Runs one line of a job through the gateway, as its endpoint's route would run the same request, with an
    idempotency key of its own (:func:`tasks.policy.batchfile.idempotency_key`): a line sent again after its first
    sending was cut off (a crash of llmb-jobs) gets that first run's answer instead of a second run."""

    def __init__(self, services: Services) -> None:
        self.services = services
        s = services.settings
        # what a line's body is parsed with: its default deadline is the jobs' (offline, so up to the offline limit)
        self.parse_settings = s.but(default_timeout_ms=min(s.jobs.line_timeout_ms, s.admission.offline_max_timeout_ms))

    def __call__(self, job: JobInfo, line: Line, generation: int = 0) -> LineResult:
        """``generation``: how many times this line's deadline passed already; each is a new run (a new key:
        the key of a run whose deadline passed answers 504 for good)."""
        started = time.monotonic()
        native = job.endpoint == "/v1/infer"
        try:
            body = parse_json(line.body.encode())  # the interactive body checks (lone surrogates: a 400)
            call, shape = self._call(job, body, line.request_id, started)
            key = idempotency_key(job.id, line.custom_id) + (f".{generation}" if generation else "")
            idempotency = Idempotency.of(key, job.endpoint, body)
            answer = self.services.gateway.submit(call, shape=shape, idempotency=idempotency)
            return LineResult(200, render(shape, shown_model(call), answer, started), ran=not answer.replayed)
        except BatchingError as exc:
            body = (NATIVE if native else OPENAI).of(exc, line.request_id)
            return LineResult(status_of(exc.type), body, exc.type, exc.retry_after_s)

    def _call(self, job: JobInfo, body: Any, request_id: str, started: float) -> tuple[Call, Shape]:
        settings = self.parse_settings
        if not isinstance(body, dict):
            raise InvalidInput("the body must be a JSON object")
        if body.get("stream"):
            raise InvalidInput("'stream' is not supported in a batch: every answer is written whole")
        route = ROUTE[job.endpoint]
        shape = Shape(route)
        if route == "completions":
            call, _ = parse_completion(body, settings, request_id, job.tenant)
            shape = Shape(route, choices=call.params.n)
        elif route == "chat":
            call, _ = parse_chat(body, settings, request_id, job.tenant)
            shape = Shape(route, choices=call.params.n)
        elif route == "embeddings":
            call, encoding = parse_embeddings(body, settings, request_id, job.tenant)
            shape = Shape(route, encoding=encoding)
        else:
            if body.get("tenant") not in (None, job.tenant):
                raise Forbidden(f"this batch belongs to tenant {job.tenant!r}, not {body['tenant']!r}; leave the "
                                "tenant out")
            call = parse_infer(body, settings, request_id, job.tenant)
            shape = Shape(route, single="input" in body)
        principal = Principal(tenant=self.services.tenants.policy(job.tenant), key_id="", admin=False)
        call = bind(replace(call, priority=Priority.OFFLINE), principal, self.services.settings, received_at=started)
        call = resolve(call, self.services.adapters, self.services.served_models)  # as every route does
        if route in KIND_FOR:
            check_model(self.services.gateway, call, route)
        return call, shape


def build(settings: Settings) -> Feeder:
    """The feeder of one llmb-jobs process, over the same services an API process builds."""
    services = Services.from_settings(settings, door=False)
    return Feeder(JobStore.from_settings(settings, services.keys.engine),
                  FileStore.from_settings(settings, services.keys.engine, services.clock),
                  LineRunner(services), settings,
                  clock=services.clock)


@click.command()
def main() -> None:
    """Run batch jobs (the Batch API's /v1/batches) on the capacity interactive traffic leaves."""
    settings = Settings.from_env()
    setup_logging(settings)
    if settings.jobs.nice > 0:
        os.nice(min(settings.jobs.nice, 19))  # offline work: the CPU, too, goes to interactive callers first
    feeder = build(settings)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping (lines in flight finish, leases are given up)", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    feeder.run(stop)
    logging.shutdown()
    os._exit(0)  # not waiting for lines still blocked past the lease: they are not finished, another process runs them


if __name__ == "__main__":
    main()
