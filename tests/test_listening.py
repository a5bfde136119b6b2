"""An API process listens for a call's results before it publishes the call: with a model faster than a publish
confirm, the wake-up (and a stream's first text) can come back before publish() returns. The recheck safety
net is set to a minute here, so a missed wake-up would show as a 504, and a missed delta as a stream whose text
does not add up to the answer."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.helpers import expected, post
from harness.stack import Stack, running_stack


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(Path(tmp_path_factory.mktemp("fast")), workers=[0, (1, {"backend": "sim-lm"})],
                       web_workers=1, result_recheck_ms=60_000, sim_batch_ms=1, wait_mode="fixed", max_wait_ms=1,
                       sim_lm_speed=200, sim_lm_eos_mean=0) as s:
        yield s


def test_a_result_that_comes_back_before_publish_returns_is_not_missed(fast: Stack) -> None:
    for i in range(40):
        r = post(fast.url, {"input": f"fast {i}", "timeout_ms": 10_000})
        assert r.status_code == 200, r.text
        assert r.json()["output"] == expected(f"fast {i}")


def test_a_stream_gets_every_piece_of_its_text(fast: Stack) -> None:
    for i in range(15):
        body: dict[str, Any] = {"model": "sim-lm", "prompt": f"stream {i}", "max_tokens": 24, "temperature": 0}
        whole = requests.post(fast.url + "/v1/completions", json=body, timeout=30)
        assert whole.status_code == 200, whole.text
        streamed = requests.post(fast.url + "/v1/completions", json={**body, "stream": True}, timeout=30,
                                 stream=True)
        assert streamed.status_code == 200
        pieces = []
        for line in streamed.iter_lines(decode_unicode=True):
            assert isinstance(line, str)  # a text/* reply has an encoding: requests decodes every line
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                pieces.append(chunk["choices"][0]["text"])
        assert "".join(pieces) == whole.json()["choices"][0]["text"], (i, pieces)
