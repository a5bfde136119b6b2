"""Keeps one worker process alive, the way an init system would, so a crash costs a restart, not the device.

A model can take its process down (an out-of-memory kill, a segfault in a kernel, a poison input). The
supervisor runs the real worker as a child and restarts it when it dies, with a growing pause between quick
failures. It does not restart a child that exits cleanly or with the "cannot start" code (for example a model
that cannot be loaded: a worker must never be half-alive). SIGTERM and SIGINT are passed to the child and
end the supervisor with it.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Sequence
from types import FrameType

log = logging.getLogger("llmb.supervisor")

CANNOT_START = 2  # exit code of a worker that must not be restarted as is
BACKOFF_S = (0.2, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 60.0  # a child that ran this long resets the backoff


def supervise(argv: Sequence[str]) -> int:
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failures = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(list(argv))
        rc = child.wait()
        if stopping or rc in (0, CANNOT_START):
            return rc
        if time.monotonic() - started > STABLE_AFTER_S:
            failures = 0
        pause = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
        failures += 1
        cause = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        log.error("worker process died (%s); restarting it in %g s", cause, pause)
        time.sleep(pause)
        if stopping:
            return rc
