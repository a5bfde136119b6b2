"""The body of a call's answer, written once for every way it is asked for: the call itself, an idempotent retry
of it (``Idempotency-Key``), and ``GET /v1/requests/<id>``; all three give the same body."""
from __future__ import annotations

import time
from typing import Any

from flask import g, request

from tasks.errors import InvalidInput
from tasks.gateway.calls import Answer
from tasks.state.records import Idempotency, Shape, valid_key
from webapp.openai_schema import chat_response, completion_response, embeddings_response

HEADER = "Idempotency-Key"


def idempotency(body: Any) -> Idempotency | None:
    """The call's Idempotency-Key with the hash of its body and route, if it gave one (400 if it is malformed)."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not valid_key(key):
        raise InvalidInput(f"the {HEADER} header must be 1-255 printable ASCII characters (a UUID, say)")
    return Idempotency.of(key, request.path, body)


def noted(answer: Answer) -> Answer:
    """An idempotent retry's answer is the first call's: it goes out under the first call's request id."""
    if answer.replayed:
        g.request_id, g.replayed = answer.request_id, True
    return answer


def render(shape: Shape, model: str, answer: Answer, started: float | None = None) -> dict[str, Any]:
    """The answer's body in the shape of the route it was asked by (a stream's: the non-streamed equivalent)."""
    if shape.route == "infer":
        return native(answer, single=shape.single, started=started)
    created = int(answer.accepted_at)
    tier = {"service_tier": shape.tier} if shape.tier else {}  # the tier that served it, when asked for one
    if shape.route == "completions":
        return completion_response(answer.request_id, model, answer.results, created=created,
                                   choices=shape.choices) | tier
    if shape.route == "chat":
        return chat_response(answer.request_id, model, answer.results, created=created, choices=shape.choices,
                             tools=shape.tool_calls) | tier
    return embeddings_response(model, answer.results, shape.encoding)


def native(answer: Answer, *, single: bool, started: float | None = None) -> dict[str, object]:
    """``POST /v1/infer``'s answer."""
    results = answer.results
    batches: dict[str, int] = {}
    for r in results:
        batches.setdefault(r.batch_id, r.batch_size)
    batch_list = [{"id": b, "size": n} for b, n in batches.items()]
    body: dict[str, object] = {"id": answer.request_id}
    if single:
        body["output"] = results[0].output
    else:
        body["outputs"] = [r.output for r in results]
        body["batches"] = batch_list
    body["batch"] = batch_list[0]
    total_ms = answer.total_ms if answer.total_ms is not None else (time.monotonic() - (started or 0.0)) * 1000
    body["timing"] = {
        "queued_ms": round(max((r.started_at - answer.accepted_at) * 1000 for r in results), 1),
        "run_ms": round(max(r.run_ms for r in results), 1),
        "total_ms": round(total_ms, 1),
    }
    return body
