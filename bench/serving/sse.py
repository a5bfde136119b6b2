"""The benchmark's client of one streamed ``/v1/completions`` call: it reads the server-sent events as they come, to
time the first token (TTFT), the last one, and the end of the stream (``data: [DONE]``)."""
from __future__ import annotations

import http.client
import json
import time
from typing import Any
from urllib.parse import urlparse


def stream_completion(url: str, body: dict[str, Any], timeout_s: float, request_id: str) -> dict[str, Any]:
    """One streamed /v1/completions call; times in ms from the moment it was sent (wall clock)."""
    target = urlparse(url)
    record: dict[str, Any] = {"status": None, "ttft_ms": None, "last_token_ms": None, "latency_ms": None,
                              "chunks": 0, "finish_reason": None}
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=timeout_s)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Request-Id": request_id})
        resp = conn.getresponse()
        record["status"] = resp.status
        if resp.status != 200:
            record["error"] = resp.read()[:300].decode(errors="replace")
            conn.close()
            return record
        while True:
            line = resp.readline()
            if not line:
                record["status"] = "truncated"  # the stream ended without [DONE]
                break
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            now = (time.monotonic() - started) * 1000
            if payload == b"[DONE]":
                record["latency_ms"] = now
                break
            event = json.loads(payload)
            if "error" in event:
                record["status"] = event["error"].get("type") or "error"
                continue
            choice = event["choices"][0]
            if choice.get("text"):
                record["chunks"] += 1
                if record["ttft_ms"] is None:
                    record["ttft_ms"] = now
                record["last_token_ms"] = now
            if choice.get("finish_reason"):
                record["finish_reason"] = choice["finish_reason"]
        conn.close()
    except OSError as exc:
        record["status"] = "client_timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
    return record
