"""Every path setting is absolute from the moment the settings are built, against the working directory then: a
relative one resolved later would depend on who reads it (Flask's send_file reads it against the package folder)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.config import Settings


def test_relative_paths_are_made_absolute_against_the_starting_directory(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = Settings.from_env({})
    assert s.jobs.files_dir == str(tmp_path / "var" / "files")
    assert s.stores.database_url == f"sqlite:///{tmp_path / 'var' / 'llmb.db'}"
    env = Settings.from_env({"LLMB_FILES_DIR": "data/f", "LLMB_DATABASE_URL": "sqlite:///db/x.db?timeout=5"})
    assert env.jobs.files_dir == str(tmp_path / "data" / "f") and Path(env.jobs.files_dir).is_absolute()
    assert env.stores.database_url == f"sqlite:///{tmp_path / 'db' / 'x.db'}?timeout=5"
    monkeypatch.chdir(tmp_path.parent)
    assert s.but(max_wait_ms=1.0).jobs.files_dir == s.jobs.files_dir, "resolved once: a later change of folder is moot"
    assert Settings.from_env({"LLMB_FILES_DIR": "~/f"}).jobs.files_dir == os.path.expanduser("~/f")


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:////abs/x.db",
                                 "postgresql+psycopg://u:p@host/db", "sqlite:///file:x.db?mode=ro&uri=true"])
def test_urls_without_a_relative_file_are_left_as_they_are(url: str) -> None:
    assert Settings.of(database_url=url).stores.database_url == url
