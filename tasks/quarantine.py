"""Quarantined inputs: an input that failed alone is refused at the door until an operator releases it.

Redis holds what is enforced (a set of input hashes, checked inside the admission script at no extra round
trip, and a hash of details per input); the ledger keeps the durable record.
"""
from __future__ import annotations

import json
import time
from typing import Any

import redis


class Quarantine:
    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key  # set of hashes; details live in key + ":info"

    @property
    def info_key(self) -> str:
        return self.key + ":info"

    def add(self, digest: str, *, model: str, reason: str, batch_id: str, request_id: str) -> None:
        info = {"hash": digest, "model": model, "reason": reason, "batch_id": batch_id,
                "request_id": request_id, "since": time.time()}
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(self.key, digest)
        pipe.hset(self.info_key, digest, json.dumps(info))
        pipe.execute()

    def release(self, digest: str) -> bool:
        pipe = self.client.pipeline(transaction=True)
        pipe.srem(self.key, digest)
        pipe.hdel(self.info_key, digest)
        removed, _ = pipe.execute()
        return bool(removed)

    def list(self) -> list[dict[str, Any]]:
        entries = [json.loads(v) for v in self.client.hgetall(self.info_key).values()]
        return sorted(entries, key=lambda e: e["since"])

    def contains(self, digest: str) -> bool:
        return bool(self.client.sismember(self.key, digest))
