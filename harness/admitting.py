"""One call admitted, or its results read, through the public round-trip API of
:class:`tasks.state.admission.Admission` (production always admits and reads in rounds; tests mostly need one)."""
from __future__ import annotations

from collections.abc import Sequence

from tasks.state.admission import Admission, AdmitCall, CollectCall, Decision, Ticket


def try_admit(admission: Admission, item_ids: Sequence[str], hashes: Sequence[str], *, ticket: Ticket, now: float,
              timeout_s: float, model_cap: int | None = None, tenant_cap: int | None = None,
              valid_until: float | None = None, tokens: Sequence[int] = (), token_cap: int = 0,
              record: tuple[str, str, int] | None = None) -> Decision:
    """Admit one call (:class:`AdmitCall` says what each field means): a round of one."""
    call = AdmitCall(tuple(item_ids), tuple(hashes), ticket, now, timeout_s, model_cap, tenant_cap,
                     tuple(tokens), token_cap, record)
    return admission.try_admit_many([call], valid_until)[0]


def collect(admission: Admission, ticket: Ticket, item_ids: Sequence[str], result_keys: Sequence[str]
            ) -> list[bytes | None]:
    """Read these items' result keys; items that have a result stop counting against the caps."""
    return admission.collect_many([CollectCall(ticket, tuple(item_ids), tuple(result_keys))])[0][0]
