"""gunicorn settings: gevent workers, so one process holds thousands of callers waiting on their results.

Prometheus counters of the API processes use prometheus_client's multiprocess mode: each worker writes
its figures to files in PROMETHEUS_MULTIPROC_DIR (a fresh folder per server unless you set one), and
/metrics adds them up across workers.
"""
import os
import shutil
import tempfile
from typing import Any

from tasks.config import Settings

_settings = Settings.from_env()

bind = _settings.web_bind
workers = _settings.web_workers
worker_class = "gevent"
worker_connections = _settings.web_connections
graceful_timeout = 10
keepalive = 5
accesslog = None  # one structured line per request comes from the app instead

_metrics_dir = os.environ.setdefault(
    "PROMETHEUS_MULTIPROC_DIR",
    os.path.join(tempfile.gettempdir(), f"llmb-metrics-{_settings.namespace}-{bind.replace(':', '_')}"),
)


def on_starting(server: Any) -> None:
    shutil.rmtree(_metrics_dir, ignore_errors=True)
    os.makedirs(_metrics_dir, exist_ok=True)


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
