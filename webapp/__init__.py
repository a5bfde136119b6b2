"""The HTTP API: a thin Flask shell over :class:`tasks.gateway.gateway.Gateway`."""
from webapp.app import create_app

__all__ = ["create_app"]
