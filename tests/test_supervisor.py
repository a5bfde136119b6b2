"""The GPU worker's supervisor with tiny child commands: what it restarts, and what stops it (no Celery needed),
and the worker's own SIGTERM guard."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from gpu_worker.drain import hear_sigterm_once
from tests.stack import ROOT, wait_for

COUNT_RUNS = "import pathlib, sys; runs = pathlib.Path(sys.argv[1]); n = len(runs.read_text()) + 1 if runs.exists() " \
             "else 1; runs.write_text('x' * n)"


def supervisor(child: str, runs: Path) -> subprocess.Popen[bytes]:
    """The supervisor as gpu-worker runs it (its own process: it takes SIGTERM and SIGINT), around ``child``."""
    code = ("import sys; from gpu_worker.supervisor import supervise; "
            f"sys.exit(supervise([sys.executable, '-c', {child!r}, {str(runs)!r}]))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)


def test_a_child_that_exits_cleanly_is_restarted_and_cannot_start_ends_it(tmp_path: Path) -> None:
    """A remote `shutdown` (Flower, `celery control`) makes the worker exit 0: that must not lose the device."""
    runs = tmp_path / "runs"
    child = COUNT_RUNS + "; sys.exit(0 if n < 3 else 2)"  # exits 0 twice, then with CANNOT_START
    proc = supervisor(child, runs)
    assert proc.wait(timeout=30) == 2
    assert len(runs.read_text()) == 3


def test_a_crashing_child_is_restarted(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    child = COUNT_RUNS + "; import os, signal; os.kill(os.getpid(), signal.SIGKILL) if n < 3 else sys.exit(2)"
    assert supervisor(child, runs).wait(timeout=30) == 2
    assert len(runs.read_text()) == 3


def test_sigterm_to_the_supervisor_stops_the_child_for_good_even_when_it_exits_0(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    # the child takes SIGTERM before it counts its run, so a run counted is a child ready for the signal; then it
    # stands for a worker busy until it is told to stop
    child = ("import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); " + COUNT_RUNS
             + "; signal.pause()")
    proc = supervisor(child, runs)
    wait_for(lambda: runs.exists(), 20, "the child to start and take SIGTERM")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, "the child's graceful exit code"
    assert len(runs.read_text()) == 1, "not restarted"


def test_a_worker_hears_only_the_first_sigterm() -> None:
    """A process-group stop delivers SIGTERM twice; Celery's handler must run once (it is not reentrant)."""
    heard: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: heard.append(signum))
    try:
        hear_sigterm_once()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert heard == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
