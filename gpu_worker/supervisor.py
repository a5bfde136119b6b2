"""Keeps one worker process alive, the way an init system would, so a crash costs a restart, not the device.

A model can take its process down (an out-of-memory kill, a segfault in a kernel, a poison input). The
supervisor runs the real worker as a child and restarts it when it dies, with a growing pause between quick
failures. It restarts a child that exits with any code but the two final ones: ``CANNOT_START`` (for example a
model that cannot be loaded: a worker must never be half-alive) and ``DEVICE_TAKEN`` (another live worker holds
this device, :mod:`gpu_worker.device_lock`: a second start would be refused the same way). A clean exit 0 is
restarted too: a worker told to shut down by anyone but this supervisor (Celery's remote ``shutdown`` control,
sent through Flower or ``celery control``) must not take its device out of the fleet for good. Only SIGTERM or
SIGINT to the supervisor itself stops it: they are passed to the child, and end the supervisor with it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from types import FrameType

log = logging.getLogger("llmb.supervisor")

CANNOT_START = 2  # exit code of a worker that must not be restarted as is
DEVICE_TAKEN = 3  # exit code of a worker refused because another live worker holds its device
FINAL = (CANNOT_START, DEVICE_TAKEN)  # exit codes the supervisor passes on instead of restarting
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
BACKOFF_S = (0.2, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 60.0  # a child that ran this long resets the backoff


def _stop_with(supervisor_pid: int) -> Callable[[], None]:
    """In the child, before it runs the worker: SIGTERM it (a graceful stop, handing its batches back) when
    the supervisor dies, so a SIGKILLed supervisor never leaves an unsupervised worker behind (Linux)."""

    def arrange() -> None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # not Linux: the child outlives a killed supervisor
            return
        if os.getppid() != supervisor_pid:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arrange


def supervise(argv: Sequence[str]) -> int:
    """Run ``argv`` until it exits with one of the FINAL codes or the supervisor is told to stop; the child's last
    code."""
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
        child = subprocess.Popen(list(argv), preexec_fn=_stop_with(os.getpid()))
        if stopping:  # told to stop while the child was starting: it missed the forwarded signal
            child.terminate()
        rc = child.wait()
        if stopping or rc in FINAL:
            if rc == DEVICE_TAKEN:
                log.error("worker refused to start: its device is held by another worker (above); not restarting it")
            return rc
        if time.monotonic() - started > STABLE_AFTER_S:
            failures = 0
        pause = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
        failures += 1
        cause = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        log.error("worker process %s (%s); restarting it in %g s", "exited" if rc == 0 else "died", cause, pause)
        time.sleep(pause)
        if stopping:
            return rc
