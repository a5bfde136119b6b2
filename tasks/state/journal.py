"""The text a worker streams, kept in Redis so that a stream can be resumed by any API process.

Streamed text goes to the waiting API process by pub/sub (:meth:`tasks.state.results.ResultWriter.stream`), which
keeps nothing: if that process dies, or its client's connection does, the text is gone with it. So each piece
is also appended to a Redis stream per item, ``<ns>:journal:<item id>`` (:class:`Journal`), with the offset in
the item's text where it starts; a resumed stream (:mod:`tasks.gateway.resume`) reads it from the start and
sends what its client lacks, then the item's result. The journal expires with the results
(``LLMB_RESULT_TTL_S`` after its last piece) and holds at most :data:`MAX_ENTRIES` pieces (trimmed oldest
first): a resumed client whose position was trimmed away gets the rest of its text from the result when the
item ends. Whether a client came back is marked under ``<ns>:resumed:<tenant>:<request id>:<first item id>``: the
API process its client left waits that long before it cancels the generation. The call's own first item names
it, so that a later call reusing its request id is not taken for resumed (it is cancelled when its client leaves).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from tasks.state.keys import Keys

MAX_ENTRIES = 100_000  # pieces of text per item kept at most (a piece is one step's text: a token or a few)

Piece = tuple[str, int, str]  # (stream entry id, offset in the item's text, text)


class Journal:
    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s

    def append(self, pipe: Any, item_id: str, offset: int, text: str) -> None:
        """Add a piece to a pipeline (the worker's, with the pub/sub message that streams it)."""
        key = self.keys.journal(item_id)
        pipe.xadd(key, {"o": offset, "t": text}, maxlen=MAX_ENTRIES, approximate=True)
        pipe.expire(key, self.ttl_s)  # each time: a journal outlives its last piece by a result's lifetime

    def read(self, after: dict[str, str]) -> dict[str, list[Piece]]:
        """The pieces of these items after the stream entry ids given (``"0-0"``: from the start)."""
        streams = {self.keys.journal(item_id): last for item_id, last in after.items()}
        item_of = {self.keys.journal(item_id): item_id for item_id in after}
        found: Any = self.client.xread(streams)  # type: ignore[arg-type]
        out: dict[str, list[Piece]] = {}
        for key, entries in found or ():
            name = key.decode() if isinstance(key, bytes) else key
            out[item_of[name]] = [(_text(entry_id), int(fields[b"o"]), fields[b"t"].decode("utf-8", "replace"))
                                  for entry_id, fields in entries]
        return out

    def mark_resumed(self, tenant: str, request_id: str, items: Sequence[str]) -> None:
        """A client came back for this call (its ``items``): the process it left must not cancel its generation."""
        self.client.set(self.keys.resumed(tenant, request_id, items[0]), 1, ex=self.ttl_s)

    def resumed(self, tenant: str, request_id: str, items: Sequence[str]) -> bool:
        return bool(self.client.exists(self.keys.resumed(tenant, request_id, items[0])))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
