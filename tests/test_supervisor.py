"""The GPU worker's supervisor with tiny child commands: what it restarts, and what stops it (no Celery needed),
and the worker's own SIGTERM guard. Then real `gpu-worker` processes (real RabbitMQ and Redis): a second worker
for a device a live one holds is refused at once and not restarted; a worker restarted after a crash is not."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from gpu_worker import supervisor as supervision
from gpu_worker.drain import hear_sigterm_once
from harness.helpers import expected
from harness.stack import BIN, ROOT, Stack, running_stack, wait_for

HERE = socket.gethostname()

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


# -- real workers: one per device; a restart after a crash takes the device back -----------------------------
@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """One sim worker (gpu0), the batcher and gunicorn, serving."""
    with running_stack(tmp_path, ready=False) as s:
        s.wait_serving(workers=1)
        yield s


def second_worker(stack: Stack, name: str, device: int = 0) -> subprocess.Popen[bytes]:
    """Another `gpu-worker --gpu <device>` as an operator would start it (supervised), beside the stack's."""
    return stack._spawn(name, [str(BIN / "gpu-worker"), "--gpu", str(device), "--host", "test", "--backend", "sim"])


def serves(stack: Stack) -> None:
    probe = f"probe {uuid.uuid4().hex}"
    r = requests.post(stack.url + "/v1/infer", json={"input": probe, "timeout_ms": 10_000}, timeout=30)
    assert r.status_code == 200 and r.json().get("output") == expected(probe), r.text


def fresh_heartbeat_after(stack: Stack, since: float) -> bool:
    """Whether gpu0 has beaten, serving (idle or busy), since ``since`` (a ``time.time()``)."""
    beat = stack.fleet().get("gpu0@test")
    return beat is not None and float(str(beat["heartbeat_at"])) > since and beat["state"] in ("idle", "busy")


def test_a_second_worker_for_a_held_device_is_refused_at_once_naming_the_holder(stack: Stack) -> None:
    holder_pid = stack.worker_child(0)
    started = time.monotonic()
    dup = second_worker(stack, "gpu0-again")
    try:
        rc = dup.wait(timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a second gpu-worker --gpu 0 still runs after 20 s "
                             f"(restarted by its supervisor?):\n{stack.log('gpu0-again')[-3000:]}") from None
    took = time.monotonic() - started
    log = stack.log("gpu0-again")
    assert rc == supervision.DEVICE_TAKEN, f"exit code {rc}:\n{log[-3000:]}"
    assert took < 10, f"refused only after {took:.1f} s"
    assert f"device gpu0@test is already held by pid {holder_pid} on host {HERE}" in log, log[-3000:]
    assert "; restarting it in" not in log and log.count("already held by") == 1, "restarted by its supervisor"
    assert "Traceback" not in log and "RESOURCE_LOCKED" not in log, log[-3000:]
    assert "Connected to amqp" not in log, "it got as far as starting Celery (the model was loaded)"

    # the holder is untouched: the same process, beating, in the fleet view, serving
    refused_at = time.time()
    assert stack.worker_child(0) == holder_pid and stack.procs["gpu0"].poll() is None
    wait_for(lambda: fresh_heartbeat_after(stack, refused_at), 10, "a heartbeat from the holder after the refusal")
    serves(stack)
    assert stack.worker_child(0) == holder_pid


def test_a_worker_restarted_after_its_process_was_killed_takes_its_device_back(stack: Stack) -> None:
    """The crashed worker's heartbeat is still fresh when its supervisor starts the next one: the lock, released
    with the dead process's connection, decides, not the heartbeat."""
    dead = stack.worker_child(0)
    os.kill(dead, signal.SIGKILL)
    wait_for(lambda: [pid for pid in stack.children("gpu0") if pid != dead], 10, "the supervisor's restart")
    restarted = stack.worker_child(0)
    since = time.time()
    wait_for(lambda: fresh_heartbeat_after(stack, since), 30, "a heartbeat from the restarted worker")
    serves(stack)
    assert stack.worker_child(0) == restarted, "the restarted worker was refused (and restarted again)"
    assert "already held" not in stack.log("gpu0")


def test_a_worker_started_right_after_its_host_lost_the_last_one_takes_the_device(stack: Stack) -> None:
    """Supervisor and worker SIGKILLed (a host lost, a `kill -9` of the group), a new `gpu-worker --gpu 0` started
    at once, while the dead one's heartbeat is fresh."""
    stack.kill("gpu0", signal.SIGKILL)
    since = time.time()
    second_worker(stack, "gpu0")
    wait_for(lambda: fresh_heartbeat_after(stack, since), 30, "a heartbeat from the new worker")
    serves(stack)
    assert stack.procs["gpu0"].poll() is None and "already held" not in stack.log("gpu0")
