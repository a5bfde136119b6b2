"""The `llmb-admin` group itself: its connection options, the :class:`Admin` object every command is handed,
and the error helpers the command modules share.

Connection settings come from the same ``LLMB_*`` variables as every process, or from the group's options.
"""
from __future__ import annotations

import uuid
from typing import NoReturn

import click
import redis
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from tasks.broker.queues import RequestPublisher
from tasks.config import Settings
from tasks.gateway.gateway import Gateway
from tasks.state.admission import Admission
from tasks.state.clock import SharedClock
from tasks.state.connect import redis_client
from tasks.state.fleet import Fleet
from tasks.state.keys import Keys
from tasks.state.quarantine import Quarantine
from tasks.store.ledger import Ledger
from tasks.store.models import make_engine


class Admin:
    """What the commands share: settings and lazily opened connections."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._redis: redis.Redis | None = None

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis_client(self.settings, socket_timeout=5, socket_connect_timeout=2)
        return self._redis

    @property
    def keys(self) -> Keys:
        return Keys.from_settings(self.settings)

    def fleet(self) -> Fleet:
        return Fleet.from_settings(self.settings, self.redis)

    def clock(self) -> SharedClock:
        """The fleet's shared wall clock (heartbeats and deadlines are on it)."""
        return SharedClock.from_settings(self.settings, self.redis)

    def admission(self) -> Admission:
        return Admission.from_settings(self.settings, self.redis)

    def quarantine(self) -> Quarantine:
        return Quarantine.from_settings(self.settings, self.redis)

    def ledger(self) -> Ledger:
        return Ledger.from_settings(self.settings)

    def session(self) -> Session:
        return Session(make_engine(self.settings.stores.database_url))

    def publisher(self, pool_size: int = 1) -> RequestPublisher:
        s = self.settings
        return RequestPublisher(s.broker.url, s.request_queue, pool_size, queue_type=s.broker.queue_type)

    def gateway(self) -> Gateway:
        return Gateway(self.settings, self.redis, self.publisher(4), f"cli-{uuid.uuid4().hex}")


pass_admin = click.make_pass_decorator(Admin)


def fail(message: str) -> NoReturn:
    raise click.ClickException(message)


def first_line(exc: Exception) -> str:
    """SQLAlchemy's messages go on with the statement and a link: the first line says what happened."""
    return (str(exc).splitlines() or [""])[0]


def shown_url(url: str) -> str:
    """A database URL fit to print: its password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL at all: the error about it says so
        return url


@click.group()
@click.option("--namespace", envvar="LLMB_NAMESPACE", help="Queue and key prefix [LLMB_NAMESPACE].")
@click.option("--redis-url", envvar="LLMB_REDIS_URL", help="[LLMB_REDIS_URL]")
@click.option("--broker-url", envvar="LLMB_BROKER_URL", help="[LLMB_BROKER_URL]")
@click.option("--database-url", envvar="LLMB_DATABASE_URL", help="[LLMB_DATABASE_URL]")
@click.pass_context
def cli(ctx: click.Context, **options: str | None) -> None:
    """Operate an llm-batcher system: its fleet, its queues, its ledger."""
    ctx.obj = Admin(Settings.from_env(overrides={k: v for k, v in options.items() if v}))


def main() -> None:
    cli(prog_name="llmb-admin")
