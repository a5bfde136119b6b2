"""gunicorn settings: gevent workers, so one process holds thousands of callers waiting on their results."""
from tasks.config import Settings

_settings = Settings.from_env()

bind = _settings.web_bind
workers = _settings.web_workers
worker_class = "gevent"
worker_connections = _settings.web_connections
graceful_timeout = 10
keepalive = 5
accesslog = None  # one structured line per request comes from the app instead
