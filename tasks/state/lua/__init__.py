"""The Lua scripts that ``tasks.state`` runs in Redis, one per ``.lua`` file here (shipped as package data).

Each file says at its top what its KEYS and ARGV are, index by index, and which Python builds them: the
positional interface lives next to the code that reads it. A few fragments define what several scripts share
(``now.lua``: Redis's clock; ``admission_forget.lua``, ``admission_purge.lua``, ``requests_readable.lua``...):
:func:`source` puts the fragments a script needs before it, so each is written once.

In Python, a script's KEYS and its ARGV are each built as a frozen dataclass whose fields, in order, are the
indexes the file lists (:func:`positional` lays one out), so every call names what it passes.
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from functools import cache
from importlib.resources import files
from typing import Any


@cache
def source(name: str, *fragments: str) -> str:
    """The text of script ``name`` (``name.lua``) after those of ``fragments``, in the order given (a fragment
    that needs another, as ``admission_purge`` needs ``now``, comes after it)."""
    return "".join(files(__name__).joinpath(f"{part}.lua").read_text(encoding="utf-8")
                   for part in (*fragments, name))


def positional(named: Any) -> list[Any]:
    """A KEYS or ARGV dataclass as the list the script reads: its fields in order, tuples (lists) and nested
    dataclasses spread in place."""
    out: list[Any] = []
    for f in fields(named):
        value = getattr(named, f.name)
        if is_dataclass(value):
            out += positional(value)
        elif isinstance(value, (tuple, list)):
            out += value
        else:
            out.append(value)
    return out
