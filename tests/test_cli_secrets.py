"""No command of `llmb-admin` prints a password: every path that prints the database's, Redis's or the broker's URL
(on success, and on the error of a closed port, where a driver's message may quote it) shows it masked
(:func:`tasks.cli.main.shown_url`, :func:`tasks.cli.main.first_line`)."""
from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result
from sqlalchemy.engine import make_url

from harness.stack import REDIS_URL
from tasks.cli import cli
from tasks.cli.main import first_line, shown_url
from tests.conftest import postgres_database

SECRET = "Zq9-n0t-4-pr1nt"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL database of its own, its URL carrying a password (the local server trusts loopback: it is
    ignored, so the commands' success paths run with it)."""
    with postgres_database("llmb_test") as url:
        yield str(make_url(url).set(password=SECRET))


def admin(*args: str, database_url: str, redis_url: str = REDIS_URL) -> Result:
    return CliRunner().invoke(cli, ["--namespace", f"sec{uuid.uuid4().hex[:8]}", "--redis-url", redis_url,
                                    "--broker-url", f"amqp://guest:{SECRET}@127.0.0.1:{closed_port()}//",
                                    "--database-url", database_url, *args])


def assert_masked(result: Result, *, printed: bool = True) -> None:
    text = result.output + ("" if result.exception is None else f"{type(result.exception)}: {result.exception}")
    assert SECRET not in text, text
    if printed:  # the URL is there, its password masked
        assert ":***@" in text, text


def test_the_helper_masks_every_scheme_and_what_sqlalchemy_cannot_read() -> None:
    for url in (f"postgresql+psycopg://u:{SECRET}@h:5432/db", f"redis://:{SECRET}@h:6379/0",
                f"amqp://guest:{SECRET}@h:5672//", f"rediss://u:{SECRET}@h", f"postgresql://u:a@b{SECRET}@h/db",
                f"not-a-scheme!://u:{SECRET}@h", f"quoted 'mysql://u:{SECRET}@h/db' in a message"):
        assert SECRET not in shown_url(url) and "***@" in shown_url(url), shown_url(url)
    assert shown_url("sqlite:///var/llmb.db") == "sqlite:///var/llmb.db"
    assert shown_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    url = f"redis://:{SECRET}@h:1/0"
    assert first_line(ValueError(f"auth failed for {SECRET!r}\nmore"), url) == "auth failed for '***'"


def test_db_and_replay_print_the_database_url_masked(pg_url: str) -> None:
    for args in (["db", "upgrade"], ["requeue", "no-such-id"], ["replay", "--dry-run"], ["jobs", "list"],
                 ["keys", "list"], ["tenants", "list"], ["adapters", "list"], ["db", "downgrade", "base"]):
        result = admin(*args, database_url=pg_url)
        assert_masked(result, printed=args[0] in ("db", "requeue"))
        assert args[0] != "db" or result.exit_code == 0, result.output


def test_every_database_error_path_masks_the_password() -> None:
    closed = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:{closed_port()}/llmb"
    for args in (["db", "upgrade"], ["db", "downgrade", "base"], ["requeue", "x"], ["replay", "--dry-run"],
                 ["jobs", "list"], ["jobs", "show", "x"], ["jobs", "cancel", "x"], ["keys", "list"],
                 ["tenants", "list"], ["quarantine", "list"], ["quarantine", "release", "abc"], ["adapters", "list"],
                 ["adapters", "remove", "x"]):
        result = admin(*args, database_url=closed)
        assert result.exit_code != 0 or args == ["quarantine", "list"], (args, result.output)  # (a warning)
        assert_masked(result, printed=args[0] not in ("requeue", "replay"))
    bad = f"postgresql+nosuchdriver://postgres:{SECRET}@127.0.0.1/llmb"
    assert_masked(admin("keys", "list", database_url=bad), printed=False)


def test_every_redis_error_path_masks_the_password(tmp_path: object) -> None:
    closed = f"redis://:{SECRET}@127.0.0.1:{closed_port()}/0"
    database = f"sqlite:///{tmp_path}/ledger.db"
    for args in (["workers"], ["stats", "--interval", "0.1"], ["quarantine", "list"],
                 ["quarantine", "release", "abc"], ["adapters", "add", "x", "--base", "m", "--path", "/nowhere"]):
        result = admin(*args, database_url=database, redis_url=closed)
        assert result.exit_code != 0
        assert_masked(result)
