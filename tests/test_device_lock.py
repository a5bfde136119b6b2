"""One worker per device (gpu_worker.device_lock): the holder-liveness policy alone, then a real `gpu-worker`
against a lock this test holds on the real RabbitMQ (with the holder's record in the real Redis). The same
scenarios with two real workers, and restarts after crashes, are in tests/test_supervisor.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from kombu import Connection

from gpu_worker.device_lock import Holder, holder_looks_alive, process_start
from gpu_worker.supervisor import DEVICE_TAKEN
from harness.stack import Stack, alive, running_stack, wait_for
from tests.test_supervisor import fresh_heartbeat_after

HERE = socket.gethostname()
STALE_S = 3.0


def holder(host: str = HERE, pid: int = 4242, process_start: int | None = 7) -> Holder:
    return Holder(host=host, pid=pid, worker="gpu0@h", queue="ns.gpu.h.0", since=0.0, process_start=process_start)


# -- the policy: is the process holding a lock to be believed alive? ----------------------------------------------
def test_a_holder_on_this_host_is_alive_exactly_while_its_process_runs() -> None:
    running = {(4242, 7)}

    def check(h: Holder, age_s: float | None) -> bool:
        return holder_looks_alive(h, age_s, here=HERE, stale_after_s=STALE_S,
                                  running=lambda pid, start: (pid, start) in running)

    assert check(holder(), None)
    assert check(holder(), 60.0), "a running process holds its device, whatever its heartbeat says (Redis away)"
    assert not check(holder(pid=4243), 0.1), "a crashed one is dead even while its last heartbeat is fresh"
    assert not check(holder(process_start=8), 0.1), "a reused pid is not the holder"


def test_a_holder_elsewhere_is_alive_while_its_heartbeat_is_fresh() -> None:
    def check(h: Holder | None, age_s: float | None) -> bool:
        return holder_looks_alive(h, age_s, here=HERE, stale_after_s=STALE_S, running=lambda pid, start: False)

    assert check(holder(host="elsewhere"), 0.5)
    assert not check(holder(host="elsewhere"), STALE_S + 0.1), "a vanished host: wait for the broker to notice"
    assert not check(holder(host="elsewhere"), None)
    assert check(None, None), "no record and no heartbeat: the broker's word (a live connection) is believed"
    assert not check(None, STALE_S + 0.1)


# -- a real worker against a lock held here -------------------------------------------------------------------
def hold_lock(stack: Stack, worker_id: str = "gpu0@test") -> Connection:
    """Hold a device's lock from this test process, as a worker does."""
    conn = Connection(stack.broker_url, connect_timeout=5)
    conn.ensure_connection(max_retries=3)
    conn.channel().queue_declare(queue=f"{stack.namespace}.device.{worker_id}", exclusive=True, auto_delete=True)
    return conn


def test_a_lock_held_for_a_dead_process_is_waited_for_not_refused(tmp_path: Path) -> None:
    """The broker has not yet dropped the connection of a holder that is gone (a host that vanished): the new
    worker waits for the lock instead of refusing for good, and starts once it is released."""
    with running_stack(tmp_path, workers=(), batchers=0, web_workers=None, ready=False) as stack:
        gone = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        gone_start = process_start(gone.pid)
        gone.kill()
        gone.wait()
        conn = hold_lock(stack)
        stack.redis.set(f"{stack.namespace}:device:gpu0@test",
                        holder(pid=gone.pid, process_start=gone_start).to_json())
        worker = stack.start_worker(0)
        wait_for(lambda: "looks dead; waiting for the broker" in stack.log("gpu0"), 20, "the worker to wait")
        assert worker.poll() is None
        since = time.time()
        conn.release()  # the broker drops the dead holder's connection
        wait_for(lambda: fresh_heartbeat_after(stack, since), 30, "a heartbeat once the lock was released")
        assert worker.poll() is None and alive(stack.worker_child(0))


def test_a_lock_held_by_a_live_process_refuses_even_without_its_heartbeat(tmp_path: Path) -> None:
    """A holder on this host whose process runs (here: this test) holds the device even before its first
    heartbeat (a worker still loading its model)."""
    with running_stack(tmp_path, workers=(), batchers=0, web_workers=None, ready=False) as stack:
        conn = hold_lock(stack)
        stack.redis.set(f"{stack.namespace}:device:gpu0@test",
                        holder(pid=os.getpid(), process_start=process_start(os.getpid())).to_json())
        rc = stack.start_worker(0).wait(timeout=20)
        assert rc == DEVICE_TAKEN, stack.log("gpu0")[-3000:]
        assert f"held by pid {os.getpid()} on host {HERE}" in stack.log("gpu0")
        assert "gpu0@test" not in stack.fleet(), "the refused worker wrote a heartbeat"
        conn.release()
