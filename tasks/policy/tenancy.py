"""Who a call comes from and what it may ask for: tenant names, policies and principals (pure).

One rule for a tenant's name, used by the web app, the API keys and the CLI alike, and one check of a tenant's
settings; the database side is :mod:`tasks.store.tenants`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tasks.errors import InvalidInput
from tasks.schema import Priority

MAX_WEIGHT = 1000.0  # shares are relative: 1000:1 is already "the other tenant gets the crumbs"
MAX_IN_FLIGHT = 2**31 - 1  # the column is a 32-bit integer
TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_tenant_name(name: object) -> str:
    """The name, if it is one a tenant may have; else InvalidInput (a ValueError, so the CLI reports it too)."""
    if not isinstance(name, str) or not TENANT_NAME.match(name):
        raise InvalidInput(f"tenant name {name!r} is not 1-64 characters of letters, digits, '.', '_' or '-'")
    return name


def check_priority(value: str | Priority) -> Priority:
    try:
        return Priority(value)
    except ValueError:
        raise InvalidInput(f"priority {value!r} is not one of {', '.join(p.value for p in Priority)}") from None


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    weight: float
    max_in_flight: int
    priority: Priority

    def checked(self) -> TenantPolicy:
        """This policy, if its weight and cap are in range; else InvalidInput."""
        if not (0 < self.weight <= MAX_WEIGHT and math.isfinite(self.weight)):
            raise InvalidInput(f"'weight' must be a number more than 0 and at most {MAX_WEIGHT:g}, not {self.weight}")
        if not 1 <= self.max_in_flight <= MAX_IN_FLIGHT:
            raise InvalidInput(f"'max_in_flight' must be from 1 to {MAX_IN_FLIGHT}, not {self.max_in_flight}")
        return self


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: its tenant's policy, and which key (for logs) with which rights."""

    tenant: TenantPolicy
    key_id: str
    admin: bool
