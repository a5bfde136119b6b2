"""`llmb-admin`: the operator's command line (fleet, stats, requeue, replay, quarantine, database, tenants, keys,
LoRA adapters, batch jobs, health checks).

:mod:`tasks.cli.main` defines the group and what the commands share; importing each other module adds its
commands to that group, which this package does here. ``tasks.cli:main`` is the console script.
"""
from __future__ import annotations

from tasks.cli import (  # noqa: F401  (importing them registers their commands)
    adapters,
    db,
    fleet,
    health,
    jobs,
    quarantine,
    replay,
    tenants,
)
from tasks.cli.main import cli, main

__all__ = ["cli", "main"]
