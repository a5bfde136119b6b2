"""A simulated accelerator for tests, benchmarks and capacity planning.

A batch of up to ``max_batch`` inputs takes ``batch_ms`` plus ``item_ms`` per input, however full it is (the
shape of a real GPU's cost curve); each output is derived deterministically from its input, so a test can
check that every caller got its own answer.

Poison triggers, for tests of isolation (off unless configured): an input containing ``raise_on`` makes the
whole batch raise; one containing ``kill_on`` kills the worker process mid-batch, as an out-of-memory kill
would.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.schema import SamplingParams


def sim_output(text: str) -> str:
    """The sim model's answer to ``text``: a short digest, different for different inputs."""
    return "sim:" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class SimBackend:
    name: str = "sim"
    batch_ms: float = 250.0
    item_ms: float = 0.0
    max_batch: int = 100
    raise_on: str = ""
    kill_on: str = ""
    kind: str = "sim"
    max_context: int = 0
    slots: int = 1

    def run(self, inputs: Sequence[str], params: Sequence[SamplingParams] | None = None,
            hooks: object = None) -> list[str]:
        if len(inputs) > self.max_batch:
            raise ValueError(f"batch of {len(inputs)} exceeds the simulated device's {self.max_batch}")
        time.sleep((self.batch_ms + self.item_ms * len(inputs)) / 2000)
        if self.kill_on and any(self.kill_on in text for text in inputs):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.raise_on and any(self.raise_on in text for text in inputs):
            raise RuntimeError("simulated device fault on a poison input")
        time.sleep((self.batch_ms + self.item_ms * len(inputs)) / 2000)
        return [sim_output(text) for text in inputs]
