"""The `llmb-admin` group itself: its connection options, the :class:`Admin` object every command is handed,
and the error helpers the command modules share.

Connection settings come from the same ``LLMB_*`` variables as every process, or from the group's options.
"""
from __future__ import annotations

import re
import uuid
from typing import NoReturn

import click
import redis
from sqlalchemy.orm import Session

from tasks.broker.queues import RequestPublisher
from tasks.config import Settings
from tasks.gateway.admission_queue import AdmissionQueue
from tasks.gateway.gateway import Gateway
from tasks.gateway.parts import GatewayParts
from tasks.state.admission import Admission
from tasks.state.clock import SharedClock
from tasks.state.connect import redis_client
from tasks.state.fleet import Fleet, FleetCache
from tasks.state.journal import Journal
from tasks.state.keys import Keys
from tasks.state.quarantine import Quarantine
from tasks.state.requests import Requests
from tasks.state.results import ResultListener
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
        """A gateway of its own (``llmb-admin replay``), built here as an API process builds its own."""
        s, instance_id, clock, names = self.settings, f"cli-{uuid.uuid4().hex}", self.clock(), self.keys
        workers = FleetCache(self.fleet(), s.worker.heartbeat_interval_s / 2, draining=True, wallclock=clock)
        listener = ResultListener(self.redis, names.replies(instance_id), names.result, s.stores.result_recheck_s)
        parts = GatewayParts(instance_id, self.redis, clock, Admission.from_settings(s, self.redis, instance_id),
                             Requests.from_settings(s, self.redis), workers, listener,
                             Journal(self.redis, names, s.stores.result_ttl_s), self.publisher(4))
        return Gateway(s, parts, AdmissionQueue(s, workers))


pass_admin = click.make_pass_decorator(Admin)


def fail(message: str) -> NoReturn:
    raise click.ClickException(message)


# a URL's user:password@ (the password may hold an unescaped "@": it ends at the last "@" of the word)
_USERINFO = re.compile(r"(?P<head>://[^:/@\s]*:)(?P<password>[^\s]*)@")


def shown_url(url: str) -> str:
    """A URL fit to print (the database's, Redis's, the broker's), or a text holding URLs: every password
    hidden, whatever the scheme, and whether or not the URL is one SQLAlchemy can read. Every command prints
    a URL, or an error that may quote one, through this (or :func:`first_line`)."""
    return _USERINFO.sub(r"\g<head>***@", url)


def first_line(exc: BaseException, *urls: str) -> str:
    """An error's first line (SQLAlchemy's go on with the statement and a link), fit to print: any URL in it,
    and the passwords of ``urls`` alone (a driver may quote either), hidden."""
    text = shown_url((str(exc).splitlines() or [""])[0])
    for url in urls:
        found = _USERINFO.search(url)
        if found and found.group("password"):
            text = text.replace(found.group("password"), "***")
    return text


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
