"""The README's OpenAI example, as written, against the workers the Procfile starts (what `bin/run` serves)."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.stack import ROOT, Stack, running_stack

README_URL = "http://127.0.0.1:8000/v1"


def procfile_workers() -> list[tuple[int, str]]:
    """(device, backend) of every gpu-worker line of the Procfile."""
    found = []
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith("#") or "gpu-worker" not in line:
            continue
        argv = shlex.split(line.split(":", 1)[1])
        found.append((int(argv[argv.index("--gpu") + 1]), argv[argv.index("--backend") + 1]))
    return found


def readme_openai_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### OpenAI-compatible API"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's OpenAI section has no python example"
    return match.group(1)


@pytest.fixture(scope="module")
def procfile_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workers = procfile_workers()
    assert {backend for _, backend in workers} >= {"sim", "hf-embed", "sim-lm"}, workers
    with running_stack(Path(tmp_path_factory.mktemp("readme")), web_workers=1,
                       workers=[(device, {"backend": backend}) for device, backend in workers]) as s:
        yield s


def test_the_readme_openai_example_runs_as_written(procfile_stack: Stack) -> None:
    code = readme_openai_example()
    assert README_URL in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(README_URL, procfile_stack.url + "/v1"), "README.md", "exec"), {})
    # sampled (the example leaves temperature at 1): sim-lm's answer may end early at its drawn EOS
    assert printed.getvalue().strip(), f"the stream printed {printed.getvalue()!r}"
