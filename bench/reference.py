"""The least Python can do: an in-process batcher behind a bare WSGI server, for comparison.

    python bench/reference.py --port 8100 --devices 2 --batch-ms 500

The same buffer and flush rule as the real batcher (:class:`tasks.policy.fairness.FairBuffer` over
:class:`tasks.policy.flush.FlushPolicy`, with the fixed wait ``--max-wait-ms`` rather than the adaptive one),
the same simulated device (a fixed time per batch of up to 100), the same request and answer shape, but no
broker, no Redis, no separate processes: one gevent process where a request waits on an in-memory event.
The benchmark runs the same load against it, so the report shows what the distributed system costs over
this floor.
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from typing import Any  # noqa: E402

import gevent  # noqa: E402
from gevent.event import AsyncResult, Event  # noqa: E402
from gevent.pywsgi import WSGIServer  # noqa: E402

# tasks and gpu_worker come from the project's installation (bin/ installs it, editable, into .venv), so this
# file also runs as a script (python bench/reference.py)
from gpu_worker.backends.sim import sim_output  # noqa: E402
from tasks.policy.fairness import FairBuffer  # noqa: E402
from tasks.policy.flush import FlushPolicy  # noqa: E402

Item = tuple[str, AsyncResult]


class ReferenceBatcher:
    def __init__(self, policy: FlushPolicy, devices: int, batch_s: float) -> None:
        self.buffer: FairBuffer[Item] = FairBuffer(policy)
        self.batch_s = batch_s
        self.arrived = Event()
        for _ in range(devices):
            gevent.spawn(self._device)

    def submit(self, text: str, timeout_s: float) -> tuple[str, int]:
        result: AsyncResult = AsyncResult()
        now = time.monotonic()
        self.buffer.add((text, result), now=now, deadline=now + timeout_s)
        self.arrived.set()
        return result.get(timeout=timeout_s)  # raises gevent.Timeout at the deadline

    def _device(self) -> None:
        """One simulated accelerator: takes the next ready batch whenever it is free (work-conserving)."""
        while True:
            now = time.monotonic()
            # as the real batcher does: work that cannot finish before its caller's deadline is not run
            self.buffer.drop_expired(now + self.batch_s)
            if self.buffer.is_ready(now):
                batch = [p.item for p in self.buffer.take()]
                gevent.sleep(self.batch_s)
                for text, result in batch:
                    result.set((sim_output(text), len(batch)))
                continue
            self.arrived.clear()
            self.arrived.wait(timeout=self.buffer.seconds_until_ready(now))


def make_app(batcher: ReferenceBatcher) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        def answer(status: str, body: dict[str, Any]) -> list[bytes]:
            data = json.dumps(body).encode()
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
            return [data]

        if environ["PATH_INFO"] != "/v1/infer":
            return answer("404 Not Found", {"error": {"type": "not_found"}})
        started = time.monotonic()
        try:
            body = json.loads(environ["wsgi.input"].read())
            text, timeout_s = str(body["input"]), float(body.get("timeout_ms", 30_000)) / 1000
        except (ValueError, KeyError):
            return answer("400 Bad Request", {"error": {"type": "invalid_request"}})
        try:
            output, size = batcher.submit(text, timeout_s)
        except gevent.Timeout:
            return answer("504 Gateway Timeout", {"error": {"type": "deadline_exceeded"}})
        total_ms = round((time.monotonic() - started) * 1000, 1)
        return answer("200 OK", {"output": output, "batch": {"size": size}, "timing": {"total_ms": total_ms}})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--batch-ms", type=float, default=250.0)
    ap.add_argument("--max-batch-size", type=int, default=100)
    ap.add_argument("--max-wait-ms", type=float, default=20.0)
    args = ap.parse_args()
    batcher = ReferenceBatcher(FlushPolicy(args.max_batch_size, args.max_wait_ms / 1000), args.devices,
                               args.batch_ms / 1000)
    WSGIServer(("127.0.0.1", args.port), make_app(batcher), log=None).serve_forever()


if __name__ == "__main__":
    main()
