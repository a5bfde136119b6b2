"""The one strict JSON reader of what callers send (request bodies, batch input lines, the door's peek at a body).

Python's ``json`` takes more than RFC 8259 allows, and what it takes reaches the validators as numbers they were
not written for: the bare tokens ``NaN``, ``Infinity`` and ``-Infinity``; a float literal beyond a double's range
(``1e400``), which it reads as ``inf``; and an integer literal of more than 4,300 digits, on which ``int()`` raises
a ValueError that names no field. Here each of them is a :class:`NotANumber` naming the field that holds it
(``'max_tokens'``, ``'logit_bias.50256'``, ``'messages[0].content'``), found by walking the value only when the
parser met one: a clean body pays one callback per number literal and no walk.
"""
from __future__ import annotations

import json
import math
from typing import Any

_DIGITS_SHOWN = 12


class NotANumber(ValueError):
    """A number literal no field takes; ``path`` is where (``""``: the whole value)."""

    def __init__(self, path: str, literal: str) -> None:
        self.path, self.literal = path, literal
        self.shown = _shown(literal)
        self.rule = ("numbers must be finite (no NaN or Infinity), within a double's range (about \u00b11.8e308) "
                     "and of at most 4,300 digits")
        where = f"'{path}' is" if path else "the value is"
        super().__init__(f"{where} {self.shown}, which is no JSON number this service reads: {self.rule}")


class _Refused:
    """What the parser put where a refused literal stood, until the walk finds its path."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal


def loads(text: str) -> Any:
    """``text`` as JSON, as :func:`json.loads` reads it but for the numbers above: NotANumber for those
    (json.JSONDecodeError, also a ValueError, for malformed text; RecursionError for nesting too deep)."""
    refused: list[_Refused] = []

    def constant(name: str) -> Any:
        refused.append(_Refused(name))
        return refused[-1]

    def real(literal: str) -> Any:
        value = float(literal)
        return value if math.isfinite(value) else constant(literal)

    def integer(literal: str) -> Any:
        try:
            return int(literal)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            return constant(literal)

    value = json.JSONDecoder(parse_constant=constant, parse_float=real, parse_int=integer).decode(text)
    if refused:
        try:
            path = _path_of(value, refused[0]) or ""
        except RecursionError:  # nested nearly as deep as the parser allows: the literal alone
            path = ""
        raise NotANumber(path, refused[0].literal)
    return value


def _path_of(value: Any, target: _Refused, path: str = "") -> str | None:
    """Where ``target`` is in ``value``, as a dotted path with list indexes (``a.b[2]``)."""
    if value is target:
        return path
    if isinstance(value, dict):
        children = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, child in children:
        if (found := _path_of(child, target, where)) is not None:
            return found
    return None


def _shown(literal: str) -> str:
    """A literal as a message quotes it: a long one by its start and its length, not its thousands of digits."""
    if len(literal) <= _DIGITS_SHOWN:
        return literal
    return f"{literal[:_DIGITS_SHOWN]}\u2026 (a {len(literal.lstrip('-'))}-digit number)"
