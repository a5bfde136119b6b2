"""Every Redis key and pub/sub channel of one deployment, named in one place.

All of them start with the namespace (``LLMB_NAMESPACE``), so several systems can share one Redis. Build one
:class:`Keys` per process with :meth:`Keys.from_settings`; the state objects take their names from it.

========================================  ======  ===================================================
key                                       type    what
========================================  ======  ===================================================
``<ns>:fleet``                            hash    worker id -> heartbeat (:mod:`tasks.state.fleet`)
``<ns>:fleet:returning``                  hash    worker id -> last heartbeat and hold, of a worker stopped
                                                  gracefully, awaited back (:mod:`tasks.state.fleet`)
``<ns>:inflight`` (+ ``:arrivals``,       zsets   admitted, unanswered items (:mod:`tasks.state.admission`;
``:offline``, ``:t:<tenant>``,                    the admission scripts derive the sub-keys from this
``:m:<model>[:arrivals|:offline]``)               base, in Lua too)
``<ns>:inflight:m:<model>:rate:<s>``      string  arrivals of one second, for the arrival rate
``<ns>:inflight:m:<model>[:offline]:kv``  hash    generation item id -> its estimated tokens
``<ns>:inflight:m:<model>[:offline]:kvsum`` string their sum: checked against the model's token budget
``<ns>:inflight:instances``               zset    API processes' leases, scored by expiry
``<ns>:inflight:owner:<instance>``        hash    what one API process admitted
``<ns>:quarantine`` (+ ``:info``,         set     input hashes refused at the door (:mod:`tasks.state.quarantine`)
``:loaded``)
``<ns>:claim:<batch id>``                 string  who runs a batch (:mod:`tasks.state.claims`)
``<ns>:result:<item id>``                 string  an item's answer, JSON (:mod:`tasks.state.results`)
``<ns>:request:<tenant>:<request id>``    string  a call without an Idempotency-Key: its items, shape, outcome
                                                  (:mod:`tasks.state.requests`); for a call with one, a pointer
                                                  to its record (below); a reused id names its latest call
``<ns>:idem:<tenant>:<sha256(key)>``      string  an Idempotency-Key's claim: body hash, request id, record key
``<ns>:idem:<tenant>:<sha256(key)>:record`` string the record of the call the key names, kept under the key so
                                                  that no reuse of its request id can replace it
``<ns>:journal:<item id>``                stream  a streamed item's text, piece by piece, for resuming
                                                  (:mod:`tasks.state.journal`)
``<ns>:resumed:<tenant>:<request id>:<item id>`` string a streamed call's client came back for it (the call
                                                  named by its first item: a reuse of its request id is another)
``<ns>:replies:<instance>``               channel wake-ups (and streamed text) for one API process
``<ns>:cancel``                           channel item ids whose callers went away
``<ns>:stats:<counter>``                  string  system-wide counters (items_done, tokens, ...)
``<ns>:metrics:<histogram>``              hash    bucket -> count, for /metrics
========================================  ======  ===================================================
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.config import Settings


@dataclass(frozen=True)
class Keys:
    namespace: str

    @classmethod
    def from_settings(cls, settings: Settings) -> Keys:
        return cls(settings.broker.namespace)

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    @property
    def fleet(self) -> str:
        return self._key("fleet")

    @property
    def fleet_returning(self) -> str:
        return self._key("fleet", "returning")

    @property
    def inflight(self) -> str:
        return self._key("inflight")

    @property
    def quarantine(self) -> str:
        return self._key("quarantine")

    @property
    def claims(self) -> str:
        """Prefix of the per-batch claim keys."""
        return self._key("claim")

    def result(self, item_id: str) -> str:
        return self._key("result", item_id)

    def journal(self, item_id: str) -> str:
        return self._key("journal", item_id)

    def resumed(self, tenant: str, request_id: str, first_item: str) -> str:
        return self._key("resumed", tenant, request_id, first_item)

    def request(self, tenant: str, request_id: str) -> str:
        """A call's record (``request_id`` "": the prefix of the tenant's records)."""
        return self._key("request", tenant, request_id)

    def idempotency(self, tenant: str, key_hash: str) -> str:
        return self._key("idem", tenant, key_hash)

    def idempotent_record(self, tenant: str, key_hash: str) -> str:
        """The record of the call an Idempotency-Key names: keyed by (tenant, key), never by the request id."""
        return self._key("idem", tenant, key_hash, "record")

    def replies(self, instance: str) -> str:
        return self._key("replies", instance)

    @property
    def cancel(self) -> str:
        return self._key("cancel")

    def stat(self, name: str) -> str:
        return self._key("stats", name)

    def histogram(self, name: str) -> str:
        return self._key("metrics", name)
