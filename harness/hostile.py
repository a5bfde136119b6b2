"""Hostile callers, one place for the suite (tests/test_hostile_*.py) and its report (``python -m bench.hostile``):
each scenario's call as a function of a pooled session, the steady caller beside them, and the API processes'
memory. Loopback only; every client is a keep-alive ``requests.Session`` that never retries, so a lost connection
shows as an error, not as a slow answer.

- :func:`made_up_call`: a call naming a model no worker serves (issue 43, item 1);
- :func:`random_token_call`: a call with a random bearer token (item 2);
- :func:`number_cases` / :func:`number_call`: a huge or non-finite number (or a value of another type) in one
  numeric field of one route, for every numeric field of every route (item 9);
- :func:`chat_request`, :func:`read_answers`, :func:`slow_reader`: raw HTTP for pipelined requests and clients
  that stop reading (items 3 and 4);
- :class:`Tenant`: a tenant's batch jobs (item 6).
"""
from __future__ import annotations

import json
import random
import secrets
import socket
import string
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter

JSON = {"Content-Type": "application/json"}


def pooled() -> requests.Session:
    """A keep-alive client of one connection that never retries."""
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=0, pool_connections=1, pool_maxsize=1))
    return session


def rss_kib(pids: list[int]) -> int:
    """The resident memory of ``pids`` together, from /proc (VmRSS)."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def answer_of(r: requests.Response) -> str:
    """A response as the suite counts it: its status and, for a JSON error, its code or type."""
    if not r.headers.get("Content-Type", "").startswith("application/json"):
        return f"{r.status_code} (not JSON)"
    error = r.json().get("error") if r.status_code >= 400 else None
    return f"{r.status_code} {error.get('code') or error.get('type')}" if isinstance(error, dict) else str(
        r.status_code)


def steady_calls(url: str, headers: dict[str, str] | None = None, *, count: int | None = None,
                 until: Callable[[], bool] | None = None) -> tuple[list[float], Counter[int]]:
    """A steady caller: /v1/infer calls one after another, ``count`` of them or while ``until()`` is false. Each
    one's milliseconds, and the count of each status (a connection error or time-out counts as 0)."""
    times: list[float] = []
    statuses: Counter[int] = Counter()
    with pooled() as session:
        while (count is not None and len(times) < count) or (until is not None and not until()):
            started = time.monotonic()
            try:
                r = session.post(url + "/v1/infer", json={"input": f"steady {len(times)}", "timeout_ms": 30_000},
                                 headers=headers, timeout=60)
                statuses[r.status_code] += 1
            except requests.RequestException:
                statuses[0] += 1
            times.append((time.monotonic() - started) * 1000)
    return times, statuses


def flood(call: Callable[[requests.Session, int], list[str]], calls: int, threads: int) -> dict[str, int]:
    """``calls`` hostile calls (``call(session, i)``: the answers it got, one or more) from ``threads`` pooled
    clients; the count of each answer, connection errors and time-outs as "error". Picklable with a module-level
    ``call``: the bench runs it in a process of its own, so that its CPU is not the steady caller's."""

    def client(start: int, n: int) -> Counter[str]:
        seen: Counter[str] = Counter()
        with pooled() as session:
            for i in range(start, start + n):
                try:
                    seen.update(call(session, i))
                except requests.RequestException:
                    seen["error"] += 1
        return seen

    shares = [calls // threads + (i < calls % threads) for i in range(threads)]
    starts = [sum(shares[:i]) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        return dict(sum(pool.map(client, starts, shares), Counter()))


# -- made-up models and random keys ---------------------------------------------------------------------------------
def made_up() -> str:
    return "m-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=16))


def made_up_call(session: requests.Session, url: str, i: int) -> requests.Response:
    """A call naming a made-up model: /v1/infer on even ``i``, /v1/chat/completions on odd."""
    if i % 2:
        return session.post(url + "/v1/chat/completions", timeout=30,
                            json={"model": made_up(), "messages": [{"role": "user", "content": "hi"}]})
    return session.post(url + "/v1/infer", json={"model": made_up(), "inputs": ["x"]}, timeout=30)


def random_token() -> str:
    """A bearer token shaped like a real key, known to nobody."""
    return f"llmb_{secrets.token_hex(4)}_{secrets.token_urlsafe(24)}"


def random_token_call(session: requests.Session, url: str, i: int = 0) -> requests.Response:
    return session.post(url + "/v1/infer", json={"input": "x"}, timeout=30,
                        headers={"Authorization": f"Bearer {random_token()}"})


# -- huge and non-finite numbers ------------------------------------------------------------------------------------
# JSON text no numeric field takes, by what each is: Python's json reads the bare tokens and 1e400 (as inf) unless
# told not to, an integer literal of more than 4,300 digits (10**5000; 10**4000 is read) raises a ValueError, and
# true is an int in Python
NUMBERS: dict[str, str] = {
    "1e308": "1e308", "-1e308": "-1e308", "1e400": "1e400", "-1e400": "-1e400",
    "NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity",
    "2**64": str(2**64), "-2**63-1": str(-(2**63) - 1), "10**4000": "1" + "0" * 4000,
    "10**5000": "1" + "0" * 5000,
    "true": "true", "false": "false", '"1"': '"1"', "[1]": "[1]", "[[1]]": "[[1]]", "{}": "{}",
}
FRACTION = {"1.5": "1.5"}  # for the integer fields only (1.5 is a fine temperature)
QUERY_NUMBERS = ("1e400", "NaN", "Infinity", "-1", "0", "1.5", str(2**64), "1" + "0" * 4000, "true", "[1]", "")
_SLOT = "\u2063N"  # where the number goes in a body's JSON text
CHAT = {"model": "sim-lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "sim-lm", "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": "sim-lm", "input": "hi", "max_output_tokens": 2}
BATCH = {"input_file_id": "file-none", "endpoint": "/v1/infer", "completion_window": "24h"}
# route -> body, its numeric fields (a dotted path for a nested one), those of them that are integers, and the
# hostile values a field takes for what they are (completions' "logprobs": false means none, as some clients send)
ROUTES: dict[str, tuple[dict[str, Any], tuple[str, ...], frozenset[str]]] = {
    "POST /v1/infer": ({"input": "x"}, ("timeout_ms",), frozenset()),
    "POST /v1/chat/completions": (CHAT, (
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "presence_penalty",
        "frequency_penalty", "logit_bias.42", "top_logprobs", "timeout_ms"),
        frozenset({"max_tokens", "max_completion_tokens", "seed", "n", "top_logprobs"})),
    "POST /v1/completions": (COMPLETION, (
        "max_tokens", "temperature", "top_p", "seed", "n", "presence_penalty", "frequency_penalty", "logit_bias.42",
        "logprobs", "best_of", "timeout_ms"), frozenset({"max_tokens", "seed", "n", "logprobs", "best_of"})),
    "POST /v1/embeddings": ({"model": "sim", "input": "x"}, ("timeout_ms",), frozenset()),
    "POST /v1/responses": (RESPONSE, ("max_output_tokens", "temperature", "top_p", "seed", "timeout_ms",
                                      "top_logprobs"), frozenset({"max_output_tokens", "seed", "top_logprobs"})),
    "POST /v1/batches": (BATCH, ("output_expires_after.seconds",), frozenset({"output_expires_after.seconds"})),
    "PUT /v1/admin/tenants/hostile": ({}, ("weight", "max_in_flight"), frozenset({"max_in_flight"})),
}
TAKEN = {("POST /v1/completions", "logprobs", "false")}
QUERIES = ("GET /v1/batches?limit=", "GET /v1/files?limit=")


@dataclass(frozen=True)
class NumberCase:
    """One hostile number in one field of one route: the request, and whether the field takes the value."""

    route: str  # "POST /v1/chat/completions"
    field: str  # its dotted path: "logit_bias.42"
    label: str  # the value, as NUMBERS names it
    body: bytes | None  # None: a query parameter
    taken: bool = False
    admin: bool = False  # the route needs an admin key

    def named_in(self, message: str) -> bool:
        """Whether a refusal's message names the field (quoted, alone or at the start of a dotted path:
        'logit_bias' or 'logit_bias.42')."""
        return f"'{self.field.split('.')[0]}" in message


def _with(body: dict[str, Any], field: str) -> dict[str, Any]:
    """``body`` with ``field`` (a dotted path) holding the slot for the number; the others in place."""
    out = json.loads(json.dumps(body))
    *parents, last = field.split(".")
    at = out
    for part in parents:
        at = at.setdefault(part, {"anchor": "created_at"} if part == "output_expires_after" else {})
    at[last] = _SLOT
    if field == "top_logprobs" and "messages" in out:
        out["logprobs"] = True  # chat's top_logprobs is read only with logprobs
    return out


def number_cases() -> list[NumberCase]:
    """Every hostile value in every numeric field of every route, and in every numeric query parameter."""
    cases = []
    for route, (body, fields, integers) in ROUTES.items():
        for field in fields:
            text = json.dumps(_with(body, field))
            for label, raw in {**NUMBERS, **(FRACTION if field in integers else {})}.items():
                cases.append(NumberCase(route, field, label, text.replace(json.dumps(_SLOT), raw).encode(),
                                        taken=(route, field, label) in TAKEN, admin="/admin/" in route))
    for query in QUERIES:
        cases += [NumberCase(query, "limit", value, None) for value in QUERY_NUMBERS]
    return cases


def number_call(session: requests.Session, url: str, case: NumberCase,
                headers: dict[str, str] | None = None) -> requests.Response:
    method, path = case.route.split(" ", 1)
    if case.body is None:
        return session.request(method, url + path + requests.utils.quote(case.label), headers=headers, timeout=30)
    return session.request(method, url + path, data=case.body, headers={**JSON, **(headers or {})}, timeout=30)


# -- raw connections ------------------------------------------------------------------------------------------------
def chat_request(request_id: str, model: str = "sim-lm", max_tokens: int = 2, prompt: str = "hi",
                 **more: Any) -> bytes:
    """A /v1/chat/completions request as the bytes a client writes."""
    raw = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                      **more}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s") % (request_id.encode(), len(raw), raw)


def read_answers(sock: socket.socket, count: int, limit_s: float) -> tuple[list[tuple[int, dict[str, str]]], bool,
                                                                           bytes]:
    """Up to ``count`` whole responses (Content-Length framed) as they come, until ``limit_s`` passes or the server
    closes; whether it reset the connection, and any bytes after the last whole response."""
    out: list[tuple[int, dict[str, str]]] = []
    data, reset, deadline = b"", False, time.monotonic() + limit_s
    while len(out) < count and time.monotonic() < deadline:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            status_line, *lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
            length = int(headers.get("content-length", "0"))
            if len(rest) >= length:
                out.append((int(status_line.split()[1]), headers))
                data = rest[length:]
                continue
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            reset = True
            break
        if not chunk:
            break
        data += chunk
    return out, reset, data


def pipelined(port: int, tag: str, count: int = 10) -> list[str]:
    """``count`` chat requests in one write on a new connection, one in five naming a made-up model (404) and one
    in five invalid (400): each answer as :func:`answer_of` counts it ("misordered" when an answer is not its own
    request's, by X-Request-Id; "lost" for each request never answered)."""
    sent = []
    for i in range(count):
        rid = f"{tag}-{i}"
        more: dict[str, Any] = {"model": made_up()} if i % 5 == 1 else {"max_tokens": -1} if i % 5 == 3 else {}
        sent.append((rid, chat_request(rid, **more)))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"".join(raw for _, raw in sent))
        answers, _, _ = read_answers(sock, count, 60)
    out = [str(status) if headers.get("x-request-id") == rid else "misordered"
           for (rid, _), (status, headers) in zip(sent, answers, strict=False)]
    return out + ["lost"] * (count - len(answers))


def slow_reader(port: int, request: bytes) -> socket.socket:
    """A raw connection that sends ``request`` and never reads: a small window and segments, so that what the
    server writes fills the buffers between them after a few tens of KB, not megabytes (loopback's 64 KB MSS)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


# -- batch jobs -----------------------------------------------------------------------------------------------------
class Tenant:
    """A tenant's calls to the Batch API with its key."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.headers = {"Authorization": "Bearer " + key}

    def upload(self, n: int, model: str | None = None) -> str:
        lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/infer",
                                    "body": {"input": f"\"quoted\" text {i} " * 20,
                                             **({"model": model} if model else {})}}) + "\n" for i in range(n))
        r = requests.post(self.url + "/v1/files", headers=self.headers, data={"purpose": "batch"},
                          files={"file": ("in.jsonl", lines.encode())}, timeout=30)
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    def create(self, file_id: str) -> requests.Response:
        return requests.post(self.url + "/v1/batches", headers=self.headers, timeout=30, json={
            "input_file_id": file_id, "endpoint": "/v1/infer", "completion_window": "24h"})

    def status(self, batch_id: str) -> str:
        r = requests.get(f"{self.url}/v1/batches/{batch_id}", headers=self.headers, timeout=30)
        return str(r.json()["status"])

    def cancel(self, batch_id: str) -> None:
        r = requests.post(f"{self.url}/v1/batches/{batch_id}/cancel", headers=self.headers, timeout=30)
        assert r.status_code == 200, r.text
