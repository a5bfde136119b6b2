"""The system under test of the LLM benchmark (``harness/stack.py``'s ``Stack``, in a namespace of its own) and
its workers' lifecycle: one worker at a time, started and waited ready, waited idle, stopped gracefully; the
counters ``llmb-admin stats`` reads, directly and through the command itself."""
from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

from harness.stack import Stack, wait_for


def start_stack(tmp: Path, max_tokens: int, web_workers: int) -> Stack:
    stack = Stack(tmp, max_tokens_cap=max_tokens, sim_lm_eos_mean=0, log_level="WARNING")
    try:
        stack.start_batcher()
        stack.start_web(workers=web_workers)
    except BaseException:
        stack.close()
        raise
    return stack


def worker_id(device: int) -> str:
    return f"gpu{device}@test"


def start_worker(stack: Stack, device: int, backend: str, env: dict[str, object] | None = None,
                 timeout_s: float = 120) -> None:
    stack.start_worker(device, backend, None, **(env or {}))
    wid = worker_id(device)

    def ready() -> bool:
        if stack.procs[f"gpu{device}"].poll() is not None:
            raise RuntimeError(f"the {backend} worker exited:\n{stack.log(f'gpu{device}')[-2000:]}")
        beat = stack.fleet().get(wid)
        return beat is not None and beat.get("state") == "idle"

    wait_for(ready, timeout_s, f"the {backend} worker {wid}")


def stop_worker(stack: Stack, device: int) -> None:
    """A graceful stop: the worker hands back what it holds and leaves the fleet view."""
    stack.kill(f"gpu{device}", sig=signal.SIGTERM)
    wid = worker_id(device)
    try:
        wait_for(lambda: wid not in stack.fleet(), 15, f"{wid} to leave the fleet")
    except TimeoutError:
        stack.redis.hdel(f"{stack.namespace}:fleet", wid)


def wait_idle(stack: Stack, device: int, timeout_s: float = 60) -> None:
    wid = worker_id(device)

    def idle() -> bool:
        beat = stack.fleet().get(wid) or {}
        return beat.get("state") == "idle" and not int(beat.get("outstanding") or 0)

    wait_for(idle, timeout_s, f"{wid} idle")


def counters(stack: Stack) -> dict[str, float]:
    """The workers' counters that ``llmb-admin stats`` reads: tokens, items, batches and busy seconds."""
    from tasks.config import Settings
    from tasks.state.metrics import Stats

    stats = Stats.from_settings(Settings.from_env(stack.env), stack.redis)
    return {**{k: float(v) for k, v in stats.counters().items()}, "busy_s": stats.busy_seconds()}


def admin_stats(stack: Stack, interval_s: float, out: dict[str, Any]) -> threading.Thread:
    """``llmb-admin stats --json`` over ``interval_s``, in the background (its report lands in ``out``)."""
    def run() -> None:
        done = stack.admin("stats", "--json", "--interval", f"{max(0.1, interval_s):.2f}", check=False)
        try:
            out.update(json.loads(done.stdout))
        except ValueError:
            out["error"] = (done.stdout + done.stderr)[-500:]

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th
