"""The one place that builds Redis clients from ``LLMB_REDIS_URL``: a plain Redis, or the master behind Sentinel.

URL forms:

- ``redis://[[user]:[password]@]host[:port][/db]``, ``rediss://...`` (TLS), ``unix:///path.sock?db=0``: redis-py's
  own syntax, a client of one server (``redis.Redis.from_url``).
- ``redis+sentinel://[[user]:[password]@]host[:port][,host[:port]...]/<service>[/<db>]`` (port 26379 by default;
  ``[::1]:26379`` for IPv6): the master that those Sentinels name ``<service>``. The user and password are the
  Redis servers'; Sentinels that require a password of their own take it as ``?sentinel_password=...`` (and
  ``sentinel_username=...``). Other query options are redis-py's (``?socket_timeout=1``), for the servers.
  Percent-encode reserved characters in the credentials.

A Sentinel client runs on redis-py's ``SentinelConnectionPool``: each new connection asks the Sentinels where the
master is, so after a failover the next connection reaches the new master; a connection still on a demoted
master turns its ``READONLY`` error into a ConnectionError and is dropped. Commands are not retried here (as
with a plain URL): the caller sees a ConnectionError for the few seconds of a failover, and the system's own
retries (waiters re-reading their keys, workers holding their results) carry on once the master is back. Lua
scripts (``register_script``) reload themselves on the new master when it answers NOSCRIPT.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs, unquote

import redis
from redis.backoff import NoBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from tasks.config import Settings

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SYNTAX = "redis+sentinel://[[user]:[password]@]host[:port][,host[:port]...]/<service>[/<db>][?sentinel_password=...]"


class PoolExhausted(redis.ConnectionError):
    """No pooled Redis connection came free in time: this process is overloaded (Redis itself may be fine)."""


class _Bounded:
    """On a blocking pool: tell an exhausted pool apart from an unreachable Redis."""

    max_connections: int
    timeout: float | None

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get_connection(*args, **kwargs)  # type: ignore[misc]
        except redis.ConnectionError as exc:
            if "No connection available" in str(exc):  # redis-py's words for its blocking pool's timeout
                raise PoolExhausted(f"all {self.max_connections} Redis connections stayed busy for "
                                    f"{self.timeout} s") from None
            raise


class WaitingPool(_Bounded, redis.BlockingConnectionPool):
    """redis-py's blocking pool (at most ``max_connections``, callers wait ``timeout`` s for one), raising
    :class:`PoolExhausted` when none comes free."""


class SentinelWaitingPool(_Bounded, SentinelConnectionPool, redis.BlockingConnectionPool):
    """The same bound on redis-py's Sentinel pool: connections go to whatever master the Sentinels name."""

    def release(self, connection: Any) -> None:
        owned = self.owns_connection(connection)
        super().release(connection)
        if not owned:  # one to a former master, or one that never connected: its slot is free again (None)
            # the blocking pool would keep the object in its list for good: forget it
            with self._lock, contextlib.suppress(ValueError):
                self._connections.remove(connection)


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # redis-py's query options, for the servers


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(SENTINEL_SCHEME + "://")


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if not host:
        raise ValueError(f"a Sentinel address in {url!r} has no host; expected {SYNTAX}")
    try:
        return unquote(host), int(port) if port else SENTINEL_PORT
    except ValueError:
        raise ValueError(f"bad Sentinel port in {text!r} of {url!r}; expected {SYNTAX}") from None


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a ``redis+sentinel://`` URL (module docstring); ValueError naming the syntax if it is not one."""
    if not is_sentinel_url(url):
        raise ValueError(f"not a Sentinel URL: {url!r}; expected {SYNTAX}")
    rest = url[len(SENTINEL_SCHEME) + 3:]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon and secret else None
    sentinels = tuple(_host_port(h.strip(), url) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise ValueError(f"no Sentinel address in {url!r}; expected {SYNTAX}")
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"{url!r} must name the monitored service (and optionally a db number); expected {SYNTAX}")
    service, db = parts[0], 0
    if len(parts) == 2:
        try:
            db = int(parts[1])
        except ValueError:
            raise ValueError(f"bad db number {parts[1]!r} in {url!r}; expected {SYNTAX}") from None
    options: dict[str, Any] = {}
    sentinel_username = sentinel_password = None
    for name, values in parse_qs(query).items():
        value = values[0]
        if name == "sentinel_password":
            sentinel_password = value
        elif name == "sentinel_username":
            sentinel_username = value
        else:
            parser = cast("Callable[[str], Any] | None", URL_QUERY_ARGUMENT_PARSERS.get(name))
            try:
                options[name] = parser(value) if parser else value
            except (TypeError, ValueError):
                raise ValueError(f"invalid value for {name!r} in {url!r}") from None
    db = options.pop("db", db)
    return SentinelURL(sentinels, service, db, username, password, sentinel_username, sentinel_password, options)


def redis_client(source: Settings | str, *, max_connections: int | None = None, pool_timeout_s: float | None = None,
                 **options: Any) -> redis.Redis:
    """A client for ``source`` (settings, or a URL): module docstring for the URL forms.

    ``options`` are redis-py's connection options (``socket_timeout=5``, ...); the URL's query options win, as in
    redis-py. With ``max_connections`` the pool is bounded and blocking: a caller waits up to ``pool_timeout_s``
    (5 s by default) for a free connection, then gets :class:`PoolExhausted`. Without it, redis-py's default pool.
    For a Sentinel URL the socket timeouts apply to the Sentinels too.
    """
    url = source.stores.redis_url if isinstance(source, Settings) else source
    bound: dict[str, Any] = {}
    if max_connections is not None:
        bound = {"max_connections": max_connections, "timeout": 5 if pool_timeout_s is None else pool_timeout_s}
    if not is_sentinel_url(url):
        if bound:
            return redis.Redis(connection_pool=WaitingPool.from_url(url, **bound, **options))
        return redis.Redis.from_url(url, **options)
    parsed = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in {**options, **parsed.options}.items()
                                       if k.startswith("socket_")}
    sentinel_kwargs["retry"] = Retry(NoBackoff(), 0)  # a Sentinel that does not answer: ask the next one at once
    if parsed.sentinel_password is not None:
        sentinel_kwargs["password"] = parsed.sentinel_password
    if parsed.sentinel_username is not None:
        sentinel_kwargs["username"] = parsed.sentinel_username
    server: dict[str, Any] = {**options, "db": parsed.db, **parsed.options}
    if parsed.username is not None:
        server["username"] = parsed.username
    if parsed.password is not None:
        server["password"] = parsed.password
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)
    if bound:
        return sentinel.master_for(parsed.service, connection_pool_class=SentinelWaitingPool, **bound, **server)
    return sentinel.master_for(parsed.service, **server)
