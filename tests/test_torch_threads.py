"""LLMB_TORCH_THREADS: the threads torch runs a worker's operators on, set when an hf-* backend loads.

At torch's default (a spinning thread per core) a tiny model's batch of 100 took 28 s instead of 1.3 s on a
2-core host with one other busy process, and the worker's calls ran past their deadlines."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tasks.config import Settings

LOADED_THREADS = ("from gpu_worker.backends.registry import load_backend; from tasks.config import Settings; "
                  "import torch; load_backend('hf-embed', Settings.from_env()); print(torch.get_num_threads())")


def _threads(code: str, **env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if k not in ("LLMB_TORCH_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_a_worker_runs_torch_on_one_thread_by_default_and_on_what_is_set() -> None:
    assert Settings.from_env({}).worker.torch_threads == 1
    assert _threads(LOADED_THREADS) == 1
    assert _threads(LOADED_THREADS, LLMB_TORCH_THREADS="2") == 2
    assert _threads(LOADED_THREADS, LLMB_TORCH_THREADS="0") == _threads("import torch; print(torch.get_num_threads())")


def test_the_setting_takes_precedence_over_omp_num_threads_and_0_leaves_it_to_torch() -> None:
    assert _threads(LOADED_THREADS, LLMB_TORCH_THREADS="2", OMP_NUM_THREADS="1") == 2
    assert _threads(LOADED_THREADS, LLMB_TORCH_THREADS="0", OMP_NUM_THREADS="1") == 1


def test_a_negative_count_is_refused_when_the_settings_are_read() -> None:
    with pytest.raises(ValueError, match="LLMB_TORCH_THREADS"):
        Settings.from_env({"LLMB_TORCH_THREADS": "-1"})
