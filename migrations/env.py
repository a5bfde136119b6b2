"""Alembic environment: the database URL comes from LLMB_DATABASE_URL (see tasks.config), nowhere else."""
from __future__ import annotations

from alembic import context

from tasks.config import Settings
from tasks.store.models import Base, make_engine

config = context.config
url = config.get_main_option("sqlalchemy.url") or Settings.from_env().stores.database_url


target_metadata = Base.metadata


def run_offline() -> None:
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
