"""gunicorn settings: gevent workers, so one process holds thousands of callers waiting on their results.

The door holds every caller the admission caps admit (invariant 8): with ``LLMB_WEB_CONNECTIONS=0`` (the default)
each worker process takes its share of ``LLMB_ADMISSION_CAP + LLMB_OFFLINE_ADMISSION_CAP`` plus
:data:`REFUSAL_MARGIN` connections, on which the excess is refused fast (429, see :mod:`webapp.door`) instead of
waiting unanswered in the kernel's accept queue. The file-descriptor limit is raised to match and the listen
backlog sized for a burst of that many connections.

Time limits on the way in: an idle kept-alive connection waits ``LLMB_KEEPALIVE_S`` for its next request; a
request's headers must arrive within ``LLMB_HEADER_TIMEOUT_S`` of its first byte (408 otherwise,
:mod:`webapp.connections`); its body within ``LLMB_BODY_TIMEOUT_S`` (:mod:`webapp.body`, 408). gunicorn's own
``keepalive`` is set to the idle limit and must stay > 0: with 0 gunicorn parses headers with no time limit.

Prometheus counters of the API processes use prometheus_client's multiprocess mode: each worker writes
its figures to files in PROMETHEUS_MULTIPROC_DIR (a fresh folder per server unless you set one), and
/metrics adds them up across workers. With ``LLMB_METRICS_BIND`` /metrics is served on that address instead of the
API's (its series name tenants: operators keep it off the public port): the master binds it once, before it forks
(a port already taken stops the server at its start), and every worker serves it beside the API, as gunicorn
shares its own listener; whichever worker accepts a scrape answers it with every process's figures.
"""
import math
import os
import resource
import shutil
import socket
import tempfile
from typing import Any

from tasks.config import Settings

REFUSAL_MARGIN = 1000  # connections per worker beyond its share of the caps, on which the excess is refused fast
SPARE_FDS = 256  # per worker, beyond its connections: Redis and RabbitMQ pools, the database, logs, metrics files


def connections_per_worker(settings: Settings) -> int:
    """LLMB_WEB_CONNECTIONS, or (0) this worker's share of both admission caps plus the refusal margin.

    The share is the one :func:`webapp.door.process_share` refuses beyond (not imported: this module loads in
    gunicorn's master, which must not import the app and its gevent-sensitive clients before the fork).
    """
    if settings.web.connections > 0:
        return settings.web.connections
    share = math.ceil((settings.admission.cap + settings.admission.offline_cap) / max(1, settings.web.workers))
    return share + REFUSAL_MARGIN


def raise_fd_limit(wanted: int) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (workers inherit it); (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


_settings = Settings.from_env()

bind = _settings.web.bind
workers = _settings.web.workers
worker_class = "webapp.worker.ArrivalTimingWorker"  # gevent, noting when connections arrive
worker_connections = connections_per_worker(_settings)
backlog = max(2048, worker_connections)  # the kernel caps it at net.core.somaxconn
graceful_timeout = math.ceil(_settings.web.graceful_s)  # calls held at SIGTERM are answered, not cut
keepalive = max(1,
                math.ceil(_settings.web.keepalive_s))  # idle keep-alive (webapp.connections); > 0: the keep-alive loop
accesslog = None  # one structured line per request comes from the app instead

_fds_wanted = worker_connections + SPARE_FDS
_fd_soft, _fd_hard = raise_fd_limit(_fds_wanted)

_metrics_dir = os.environ.setdefault(
    "PROMETHEUS_MULTIPROC_DIR",
    os.path.join(tempfile.gettempdir(), f"llmb-metrics-{_settings.broker.namespace}-{bind.replace(':', '_')}"),
)


def _somaxconn() -> int | None:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def on_starting(server: Any) -> None:
    shutil.rmtree(_metrics_dir, ignore_errors=True)
    os.makedirs(_metrics_dir, exist_ok=True)
    server.log.info("%d worker(s) x %d connections, listen backlog %d, file descriptors %d per process",
                    workers, worker_connections, backlog, _fd_soft)
    if _fd_soft != resource.RLIM_INFINITY and _fd_soft < _fds_wanted:
        server.log.warning("the file-descriptor limit (soft %d, hard %d) is below the %d each worker needs for %d "
                           "connections: callers past it are refused by the kernel; raise the hard limit "
                           "(ulimit -Hn, systemd LimitNOFILE=) or lower LLMB_WEB_CONNECTIONS", _fd_soft, _fd_hard,
                           _fds_wanted, worker_connections)
    somaxconn = _somaxconn()
    if somaxconn is not None and somaxconn < backlog:
        server.log.warning("net.core.somaxconn is %d, below the listen backlog %d: a burst of connections past it "
                           "is dropped by the kernel; raise it with sysctl", somaxconn, backlog)


_metrics_listener: socket.socket | None = None  # LLMB_METRICS_BIND's, bound by the master, inherited by each worker


def listen(address: str) -> socket.socket:
    """A listening socket on ``address`` (``host:port``, ``[v6]:port``), for the workers to inherit."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"LLMB_METRICS_BIND must read host:port, not {address!r}")
    family, kind, proto, _, where = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(where)
    sock.listen(64)
    return sock


def when_ready(server: Any) -> None:  # in the master, before the first fork
    global _metrics_listener
    if _settings.web.metrics_bind and _metrics_listener is None:
        _metrics_listener = listen(_settings.web.metrics_bind)
        server.log.info("/metrics served on %s (not on %s)", _settings.web.metrics_bind, bind)


def serve_metrics(inherited: socket.socket, app: Any) -> None:
    """Serve the metrics registry of ``app`` (:func:`webapp.create_app`'s) on the inherited listener, in this
    gevent worker beside the API (any path answers, as prometheus_client's own server does)."""
    import gevent.socket
    from gevent.pywsgi import WSGIServer
    from prometheus_client import make_wsgi_app

    from webapp.services import services

    own = gevent.socket.socket(inherited.family, inherited.type, inherited.proto, fileno=os.dup(inherited.fileno()))
    WSGIServer(own, make_wsgi_app(services(app).metrics), log=None).start()


def post_worker_init(worker: Any) -> None:
    import gevent

    from tasks.heap import settle
    from webapp.services import services

    if _metrics_listener is not None:
        serve_metrics(_metrics_listener, worker.wsgi)
    gevent.spawn(services(worker.wsgi).warm_up)  # before a first burst needs it, without holding up the start
    settle()  # the app is loaded: freeze it out of the garbage collector's full collections


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
