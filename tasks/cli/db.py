"""`llmb-admin db`: create, upgrade or downgrade the ledger's schema with the Alembic migrations in
``migrations/`` at the repository root.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from tasks.cli.main import Admin, cli, pass_admin

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


@cli.group()
def db() -> None:
    """The ledger's schema (Alembic migrations)."""


def _alembic(admin: Admin) -> Config:
    from alembic.config import Config

    config = Config(str(MIGRATIONS / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", admin.settings.stores.database_url.replace("%", "%%"))
    return config


@db.command()
@click.option("--revision", default="head", show_default=True)
@pass_admin
def upgrade(admin: Admin, revision: str) -> None:
    """Create or upgrade the ledger's tables."""
    from alembic import command

    command.upgrade(_alembic(admin), revision)
    click.echo(f"database at {admin.settings.stores.database_url} is at {revision}")


@db.command()
@click.argument("revision")
@pass_admin
def downgrade(admin: Admin, revision: str) -> None:
    """Go back to an older schema revision ("base" removes every table)."""
    from alembic import command

    command.downgrade(_alembic(admin), revision)
    click.echo(f"database at {admin.settings.stores.database_url} is at {revision}")
