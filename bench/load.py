"""Open-loop load generator: Poisson arrivals at a fixed rate for a bounded time, one process (gevent).

    python -m bench.load --url http://127.0.0.1:8000 --rate 300 --duration 20 [--out requests.json] [--keep-alive]

Each request goes on a new connection, as a caller without a connection pool sends it; ``--keep-alive`` reuses
connections as a pool does (the summary counts the connections opened).

Arrivals are scheduled ahead of time and sent whether or not earlier requests have returned (open loop),
so a slow server cannot slow the offered load down. The generator reports its own scheduling lag: when that
is large, the figures measure the generator, not the system. It stops by itself: arrivals end after
``--duration`` and every request carries a deadline.
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import gevent  # noqa: E402
from gevent.pool import Pool  # noqa: E402

from harness.stats import percentile  # noqa: E402


def post(address: tuple[str, int], request: bytes, timeout_s: float,
         idle: list[socket.socket] | None = None) -> tuple[int, bytes]:
    """One request: (status, body). On a new connection, as a caller without connection reuse makes it; with
    ``idle`` (``--keep-alive``), on a connection left open by an earlier request when one is free, as a client's
    connection pool does (one that the server has closed meanwhile is replaced, and the request sent again).

    A plain socket rather than http.client: the generator shares the host with the system it measures, and
    http.client's header parsing (the email package) cost 0.6 ms of CPU a request, 0.7 of the two cores at
    1,200 requests/s, taken from the system under test. The answer is read by its Content-Length (or its chunks,
    or to the close); ``timeout_s`` bounds each wait on the socket, as http.client's timeout did."""
    reused = bool(idle)
    sock = idle.pop() if idle else _connect(address, timeout_s)
    keep = False
    try:
        status, body, keep = _exchange(sock, request)
        return status, body
    except ConnectionError:
        if not reused:
            raise
        return post(address, request, timeout_s, idle)  # the kept connection had been closed: the next one
    finally:
        if keep and idle is not None:
            idle.append(sock)
        else:
            sock.close()


opened = 0  # connections this process opened (the summary's "connections")


def _connect(address: tuple[str, int], timeout_s: float) -> socket.socket:
    global opened
    opened += 1
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes, bool]:
    """Send ``request`` and read its answer: (status, body, whether the connection may carry another)."""
    sock.sendall(request)
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0:
        data += _recv(sock)
    head, rest = data[:end].decode("latin-1"), data[end + 4:]
    status = int(head.split(" ", 2)[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:])}
    if "content-length" in fields:
        length = int(fields["content-length"])
        while len(rest) < length:
            rest += _recv(sock)
        return status, rest[:length], fields.get("connection", "").lower() != "close"
    chunked = "chunked" in fields.get("transfer-encoding", "")
    while not (chunked and rest.endswith(b"0\r\n\r\n")):
        try:
            rest += _recv(sock)
        except ConnectionError:
            break
    return status, _unchunk(rest) if chunked else rest, False


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("the server closed the connection before its answer was complete")
    return data


def _unchunk(data: bytes) -> bytes:
    out, pos = b"", 0
    while True:
        line_end = data.index(b"\r\n", pos)
        size = int(data[pos:line_end].split(b";")[0], 16)
        if size == 0:
            return out
        out += data[line_end + 2:line_end + 2 + size]
        pos = line_end + 2 + size + 2


def run(url: str, rate: float, duration: float, timeout_ms: int, *, seed: int = 1, tenant: str | None = None,
        poison_every: int = 0, poison_marker: str = "", concurrency: int = 10_000, key: str | None = None,
        priority: str | None = None, client_timeout_ms: int | None = None, keep_alive: bool = False,
        count: int | None = None) -> dict[str, Any]:
    """Offer ``rate`` requests/s for ``duration`` s (or, with ``count``, until that many are sent); returns a
    summary and one record per request.

    ``timeout_ms`` is the deadline sent to the server; the client gives up at ``client_timeout_ms`` (default: the
    server's deadline + 30 s), and an answer after that counts as a client time-out."""
    client_s = (client_timeout_ms if client_timeout_ms is not None else timeout_ms + 30_000) / 1000
    target = urlparse(url)
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    lags: list[float] = []
    pool = Pool(concurrency)
    headers = {"Content-Type": "application/json"}
    if tenant:
        headers["X-Tenant"] = tenant
    if key:
        headers["Authorization"] = f"Bearer {key}"
    extra = {"priority": priority} if priority else {}

    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request_head = f"POST /v1/infer HTTP/1.1\r\nHost: {target.hostname}:{target.port}\r\n{head}"
    idle: list[socket.socket] | None = [] if keep_alive else None  # connections free for the next request
    address = (socket.gethostbyname(target.hostname or "127.0.0.1"), target.port or 80)  # resolved once

    def one(i: int, sent_at: float) -> None:
        text = f"bench {seed} {i}"
        if poison_every and i % poison_every == poison_every - 1:
            text = f"{poison_marker} {seed} {i}"
        body = json.dumps({"input": text, "timeout_ms": timeout_ms, **extra}).encode()
        record: dict[str, Any] = {"i": i, "t": round(sent_at, 4), "wall": round(time.time(), 4)}
        started = time.monotonic()
        try:
            status, data = post(address, f"{request_head}Content-Length: {len(body)}\r\n\r\n".encode() + body,
                                client_s, idle)
            record["status"] = status
            if status == 200:
                record["batch"] = json.loads(data)["batch"]["size"]
            else:  # which refusal: the error's type
                record["error"] = json.loads(data).get("error", {}).get("type") if data.startswith(b"{") else None
        except OSError as exc:  # socket.timeout is an OSError: the client's own deadline passed
            record["status"] = "client_timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
        except ValueError:  # not HTTP
            record["status"] = "bad_response"
        record["ms"] = round((time.monotonic() - started) * 1000, 2)
        records.append(record)

    t0 = time.monotonic()
    next_at, sent = 0.0, 0
    while (next_at < duration) if count is None else (sent < count):
        delay = t0 + next_at - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        lags.append(max(0.0, time.monotonic() - (t0 + next_at)) * 1000)
        pool.spawn(one, sent, next_at)
        sent += 1
        next_at += rng.expovariate(rate)
    pool.join()
    if count is not None:
        duration = next_at  # the arrivals' span
    summary = summarize(records, rate, duration, timeout_ms, lags, client_s * 1000)
    summary["connections"] = opened
    return {"summary": summary, "records": records}


def summarize(records: list[dict[str, Any]], rate: float, duration: float, timeout_ms: int,
              lags: list[float], client_timeout_ms: float | None = None) -> dict[str, Any]:
    limit = client_timeout_ms if client_timeout_ms is not None else float("inf")
    for r in records:  # a 200 the client received after it had given up is no answer to it
        if r["status"] == 200 and r["ms"] > limit:
            r["status"] = "client_timeout"
    statuses = collections.Counter(str(r["status"]) for r in records)
    ok = [r["ms"] for r in records if r["status"] == 200]
    refused = [r["ms"] for r in records if r["status"] == 429]
    sizes = [r["batch"] for r in records if "batch" in r]
    # goodput: answers 200 per second, from the first request sent to the last 200 received
    span = max((r["t"] + r["ms"] / 1000 for r in records if r["status"] == 200), default=duration)
    return {
        "offered_rps": rate, "sent": len(records), "duration_s": duration,
        "goodput_rps": round(len(ok) / max(span, duration), 1),
        "statuses": dict(statuses),
        "ok_fraction": round(len(ok) / len(records), 4) if records else None,
        "latency_ms": {q: percentile(ok, float(q[1:])) for q in ("p50", "p90", "p99")},
        "refused_latency_ms": {q: percentile(refused, float(q[1:])) for q in ("p50", "p99")},
        "mean_batch_size_seen": round(sum(sizes) / len(sizes), 1) if sizes else None,
        "late_over_100ms": sum(1 for r in records if r["ms"] > timeout_ms + 100),
        "generator_lag_ms": {"p50": percentile(lags, 50), "p99": percentile(lags, 99)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rate", type=float, required=True, help="offered requests per second")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    ap.add_argument("--count", type=int, default=None, help="send this many (at --rate), whatever the duration")
    ap.add_argument("--timeout-ms", type=int, default=5000, help="per-request deadline sent to the server")
    ap.add_argument("--client-timeout-ms", type=int, default=None,
                    help="the client gives up after this long (default: the server deadline + 30 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tenant", default=None, help="X-Tenant header (when the server runs without keys)")
    ap.add_argument("--key", default=None, help="API key, sent as Authorization: Bearer")
    ap.add_argument("--priority", choices=["interactive", "offline"], default=None)
    ap.add_argument("--poison-every", type=int, default=0, help="make every Nth input a poison one")
    ap.add_argument("--poison-marker", default="__raise_here__")
    ap.add_argument("--keep-alive", action="store_true",
                    help="reuse connections as a client's pool does (default: a new connection per request)")
    ap.add_argument("--out", help="write the summary and every request's record here (JSON)")
    args = ap.parse_args()
    # A run lasts seconds: its garbage waits for the exit, so that no collection pauses the clock of every
    # request in flight (measured: 20-40 ms full collections in a 300% run, all counted as the system's latency).
    gc.disable()
    result = run(args.url, args.rate, args.duration, args.timeout_ms, seed=args.seed, tenant=args.tenant,
                 poison_every=args.poison_every, poison_marker=args.poison_marker, key=args.key,
                 priority=args.priority, client_timeout_ms=args.client_timeout_ms, keep_alive=args.keep_alive,
                 count=args.count)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
