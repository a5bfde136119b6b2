"""The README's Batch API example, as written, on the default paths: every process started from a folder of its own
(as bin/run starts the Procfile's from the repository root) with ``LLMB_FILES_DIR`` and ``LLMB_DATABASE_URL``
unset, so the files go to the relative ``var/files`` and the database to ``var/llmb.db``. The download at its end
(``client.files.content(batch.output_file_id)``, the official client with ``max_retries=0``) answered 500 when a
relative path was resolved against the web app's package folder instead of the working directory.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from harness.stack import BIN, ROOT, Stack, running_stack

if not os.environ.get("CI"):
    pytest.importorskip("openai", reason="bin/test installs the test extra (the official openai client)")

README_URL = "http://127.0.0.1:8000/v1"
DEFAULTED = ("LLMB_FILES_DIR", "LLMB_DATABASE_URL")  # left to their defaults: relative paths


class FolderStack(Stack):
    """A stack whose processes (and `llmb-admin`) run in ``cwd`` with the path settings left to their defaults."""

    def __init__(self, tmp: Path, cwd: Path, **env: object) -> None:
        self.cwd = cwd
        cwd.mkdir(parents=True, exist_ok=True)
        super().__init__(tmp, **env)
        self.database_url = f"sqlite:///{cwd / 'var' / 'llmb.db'}"  # where the default puts it, for the checks

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {k: v for k, v in {**self.env, **(extra or {})}.items() if k not in DEFAULTED}

    def _spawn(self, name: str, argv: list[str], raw_env: dict[str, str] | None = None,
               settings: Mapping[str, object] | None = None) -> subprocess.Popen[bytes]:
        argv = [str(ROOT / a) if a == "webapp/gunicorn_conf.py" else a for a in argv]
        extra = {f"LLMB_{k.upper()}": str(v) for k, v in (settings or {}).items()} | (raw_env or {})
        with open(self.tmp / f"{name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(argv, cwd=self.cwd, env=self._env(extra), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        self.groups.add(proc.pid)
        return proc

    def admin(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(BIN / "llmb-admin"), *args], cwd=self.cwd, env=self._env(), capture_output=True,
                              text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"llmb-admin {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n"
                                 f"{done.stderr}")
        return done


def readme_batch_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text[text.index("## Batch jobs"):], re.S)
    assert match, "the README's Batch jobs section has no python example"
    return match.group(1)


@pytest.fixture(scope="module")
def default_paths_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FolderStack]:
    tmp = Path(tmp_path_factory.mktemp("batch_defaults"))
    with running_stack(tmp, workers=[(2, {"backend": "sim-lm", "sim_lm_speed": 20})],  # the Procfile's `lm`, faster
                       web_workers=1, jobs=("jobs",), factory=FolderStack, cwd=tmp / "run",
                       auth="none") as s:  # bin/run's default: no keys
        yield s


def test_the_readme_batch_example_runs_as_written_on_the_default_paths(default_paths_stack: FolderStack) -> None:
    code = readme_batch_example()
    assert README_URL in code and 'api_key="unused")' in code
    code = code.replace(README_URL, default_paths_stack.url + "/v1").replace(
        'api_key="unused")', 'api_key="unused", max_retries=0)')  # a failed download must fail, not be retried
    printed, scope = io.StringIO(), {}  # type: ignore[var-annotated]
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), scope)
    batch = scope["batch"]
    assert batch.status == "completed" and batch.request_counts.completed == 1000, printed.getvalue()
    assert scope["answer"]["response"]["status_code"] == 200, "the example read the output file's lines"
    files = default_paths_stack.cwd / "var" / "files"
    assert (files / batch.output_file_id).is_file(), "the output file is under the working directory's var/files"
    assert (default_paths_stack.cwd / "var" / "llmb.db").is_file()
    assert not (ROOT / "webapp" / "var").exists(), "nothing is written under the package folder"
