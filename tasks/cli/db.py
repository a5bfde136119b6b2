"""`llmb-admin db`: create, upgrade or downgrade the ledger's schema with the Alembic migrations in
``migrations/`` at the repository root (from a checkout), or in ``./migrations`` where the package is installed
without its repository (the container image puts them in its working directory, /app).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tasks.cli.main import Admin, cli, fail, first_line, pass_admin, shown_url

if TYPE_CHECKING:
    from alembic.config import Config

REPOSITORY_MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def migrations() -> Path:
    """The repository's migrations, else those in the working directory (an installed package's)."""
    if (REPOSITORY_MIGRATIONS / "alembic.ini").is_file():
        return REPOSITORY_MIGRATIONS
    return Path.cwd() / "migrations"


@cli.group()
def db() -> None:
    """The ledger's schema (Alembic migrations)."""


def _alembic(admin: Admin) -> Config:
    from alembic.config import Config

    config = Config(str(migrations() / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", admin.settings.stores.database_url.replace("%", "%%"))
    return config


@db.command()
@click.option("--revision", default="head", show_default=True)
@pass_admin
def upgrade(admin: Admin, revision: str) -> None:
    """Create or upgrade the ledger's tables."""
    from alembic import command

    _migrate(admin, command.upgrade, revision)


@db.command()
@click.argument("revision")
@pass_admin
def downgrade(admin: Admin, revision: str) -> None:
    """Go back to an older schema revision ("base" removes every table)."""
    from alembic import command

    _migrate(admin, command.downgrade, revision)


def _migrate(admin: Admin, step: Callable[[Config, str], None], revision: str) -> None:
    """Run an Alembic step and say where the database is now (its URL's password hidden, also in an error)."""
    from sqlalchemy.exc import SQLAlchemyError

    url = admin.settings.stores.database_url
    try:
        step(_alembic(admin), revision)
    except SQLAlchemyError as exc:
        fail(f"cannot migrate the database at {shown_url(url)}: {type(exc).__name__}: {first_line(exc, url)}")
    click.echo(f"database at {shown_url(url)} is at {revision}")
