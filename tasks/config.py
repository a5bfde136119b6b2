"""All configuration in one place, grouped by the part of the system it tunes.

Every setting is an environment variable prefixed ``LLMB_`` with a documented default (the table in
docs/configuration.md is printed from the fields below by ``python -m tasks.config``, and a test keeps it current).
In code they are read by section (``settings.batcher.max_wait_s``); the environment variable names are our users'
interface and stay flat (``LLMB_MAX_WAIT_MS``). Units are converted once, here: a setting given in milliseconds
(``..._MS``) is held in seconds (``..._s``), except the request timeouts, which are milliseconds in the API too.
Modes are enums, so a misspelt one stops the process at start with the choices it has. Settings are loaded once
per process with :meth:`Settings.from_env` and passed down through constructors: nothing else reads the
environment. Tests and tools build them with :meth:`Settings.of` / :meth:`Settings.but`, by the flat names.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from tasks.config_sections import (  # noqa: F401  (re-exported: the sections, their modes and converters)
    AdmissionSettings,
    Auth,
    BatcherSettings,
    Broker,
    HfMode,
    Jobs,
    Models,
    Process,
    QueueType,
    Sim,
    SimLmMode,
    Stores,
    Tenants,
    WaitMode,
    Web,
    Worker,
    absolute_path,
    absolute_sqlite_url,
    setting,
)

PREFIX = "LLMB_"


@dataclass(frozen=True)
class Settings:
    """Every setting of a process, by section."""

    broker: Broker = field(default_factory=Broker)
    stores: Stores = field(default_factory=Stores)
    models: Models = field(default_factory=Models)
    batcher: BatcherSettings = field(default_factory=BatcherSettings)
    tenants: Tenants = field(default_factory=Tenants)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    web: Web = field(default_factory=Web)
    worker: Worker = field(default_factory=Worker)
    jobs: Jobs = field(default_factory=Jobs)
    sim: Sim = field(default_factory=Sim)
    process: Process = field(default_factory=Process)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 overrides: Mapping[str, object] | None = None) -> Settings:
        """Build settings from ``LLMB_*`` variables; ``overrides`` (by flat name, in the variables' units) win."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {name: env[PREFIX + name.upper()] for name in FLAT if PREFIX + name.upper() in env}
        return cls().but(**{**values, **(overrides or {})})

    @classmethod
    def of(cls, **values: object) -> Settings:
        """The defaults, but for ``values`` (by flat name, in the variables' units: ``Settings.of(max_wait_ms=5)``)."""
        return cls().but(**values)

    def but(self, **values: object) -> Settings:
        """These settings, but for ``values`` (by flat name, in the variables' units; a string is parsed as the
        variable would be)."""
        changed: dict[str, dict[str, object]] = {}
        for name, value in values.items():
            if name not in FLAT:
                raise TypeError(f"there is no setting {name!r} (LLMB_{name.upper()})")
            section, f = FLAT[name]
            changed.setdefault(section, {})[f.name] = _value(name, f, value)
        return replace(self, **{s: replace(getattr(self, s), **v) for s, v in changed.items()})

    # Broker names derived from the namespace, so every component agrees on them (Redis keys: tasks.state.keys).
    @property
    def request_queue(self) -> str:
        return f"{self.broker.namespace}.requests"

    @property
    def recovery_queue(self) -> str:
        return f"{self.broker.namespace}.recovery"

    @property
    def batcher_queue(self) -> str:
        """Celery's own queue for the batcher worker (control only: requests arrive on request_queue)."""
        return f"{self.broker.namespace}.batcher"

    def gpu_queue(self, host: str, device: int | str) -> str:
        return f"{self.broker.namespace}.gpu.{host}.{device}"


# flat name -> (section, field)
FLAT: dict[str, tuple[str, Field[Any]]] = {
    f.metadata["name"]: (section.name, f)
    for section in fields(Settings) for f in fields(section.default_factory)  # type: ignore[arg-type]
}


def _value(name: str, f: Field[Any], value: object) -> object:
    """``value`` of setting ``name`` as its field holds it: parsed from a string, in the field's unit."""
    kind: type = type(f.default)
    if isinstance(value, str) and kind is not str:
        try:
            value = value.lower() in ("1", "true", "yes") if kind is bool else kind(str(value))
        except ValueError:
            choices = f" (one of {', '.join(repr(str(c)) for c in kind)})" if issubclass(kind, StrEnum) else ""
            raise ValueError(f"{PREFIX}{name.upper()}={value!r} is not a valid {kind.__name__}{choices}") from None
    elif issubclass(kind, StrEnum) and not isinstance(value, kind):
        value = kind(str(value))
    scale = f.metadata["scale"]
    return value / scale if scale != 1.0 and isinstance(value, (int, float)) else value


def documented_settings() -> list[tuple[str, str, object, str]]:
    """(variable, attribute in code, default in the variable's unit, doc) for every setting: the source of
    docs/configuration.md's table."""
    out = []
    for name, (section, f) in FLAT.items():
        default = f.default * f.metadata["scale"] if f.metadata["scale"] != 1.0 else f.default
        out.append((PREFIX + name.upper(), f"{section}.{f.name}", default, f.metadata["doc"]))
    return out


if __name__ == "__main__":
    print("| Variable | In code (`settings.`...) | Default | What it does |\n|---|---|---|---|")
    for variable, attribute, default, doc in documented_settings():
        shown = str(default) if not isinstance(default, StrEnum) else default.value
        print(f"| `{variable}` | `{attribute}` | `{shown}` | {doc} |")
