"""A call made ready for admission: the request it would be published as, the record it would be kept under,
and, once it joins a round at the door, what its admission needs."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from tasks.gateway.calls import Call
from tasks.gateway.gate import Turn
from tasks.schema import InferenceRequest, Item
from tasks.state.admission import AdmitCall
from tasks.state.records import Record, Shape


@dataclass(frozen=True)
class Prepared:
    """A call checked and ready to be admitted: its request, its record, its time and its tokens."""

    request: InferenceRequest
    record: Record
    remaining_s: float
    deadline: float  # monotonic
    item_tokens: list[int]
    token_cap: int


@dataclass(frozen=True)
class Joining:
    """A prepared call in a round at the door: what its admission needs, and its turn at the gate."""

    call: Call
    prepared: Prepared
    admit: AdmitCall
    turn: Turn


def request_of(call: Call, shape: Shape, accepted_at: float, remaining_s: float, reply_to: str,
               instance_id: str) -> tuple[InferenceRequest, Record]:
    """The request a call is published as (its items given fresh ids; its deadline ``remaining_s`` after
    ``accepted_at`` on the shared clock) and the record it is kept under, by this API process."""
    items = tuple(Item(id=uuid.uuid4().hex, input=text) for text in call.inputs)
    request = InferenceRequest(
        id=call.request_id, tenant=call.tenant, model=call.model, items=items,
        accepted_at=accepted_at, deadline=accepted_at + remaining_s, reply_to=reply_to,
        params=call.params, weight=call.weight, priority=call.priority, trace=call.trace,
    )
    # the record names the model as the caller did (an adapter by its name): what GET /v1/requests/<id> and a
    # resumed stream show
    record = Record(request_id=call.request_id, tenant=call.tenant, model=call.params.adapter or call.model,
                    items=tuple(i.id for i in items), accepted_at=accepted_at, deadline=request.deadline,
                    instance=instance_id, shape=shape)
    return request, record
