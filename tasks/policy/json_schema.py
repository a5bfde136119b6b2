"""Which JSON schemas a caller may constrain an answer with: OpenAI's strict subset and its limits (pure).

``response_format: {"type": "json_schema", ...}`` and a function tool's ``parameters`` carry a JSON schema that
the worker turns into a grammar. A schema marked ``strict`` must keep to the subset OpenAI's Structured Outputs
document (every property required, ``additionalProperties: false``, nullable by a union with ``null``, ``anyOf``,
``$defs``/``$ref``, ``enum``/``const``, arrays, and the string, number and array keywords it lists) within its
limits; one that is not strict may use more of JSON Schema (the grammar compiler judges it) but stays within the
same limits, so that no schema costs a worker more than the largest one OpenAI accepts. Either way a schema
outside them is refused here, before admission, with a message naming the keyword or the limit.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_PROPERTIES = 5000  # object properties, all objects together
MAX_DEPTH = 10  # levels of nested objects and arrays
MAX_STRING_CHARS = 120_000  # property names, definition names, enum and const values, together
MAX_ENUM_VALUES = 1000  # enum values, all enums together
LARGE_ENUM, LARGE_ENUM_CHARS = 250, 15_000  # an enum of more values than this: its strings' length at most that
MAX_SCHEMA_CHARS = 1_000_000  # the schema's JSON text (bounded before it is walked at all)
MAX_NESTING = 64  # schemas inside schemas, unions included (what bounds the walk itself)

TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated"})
STRICT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref", "$defs",
    "definitions", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems"}) | ANNOTATIONS
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})


class SchemaError(ValueError):
    """A schema outside what is supported; the message names the keyword or limit, and where (a JSON pointer)."""


@dataclass
class _Count:
    properties: int = 0
    chars: int = 0
    enum_values: int = 0
    nesting: int = 0  # schemas inside schemas where the walk is now (unions and definitions too)


def check(schema: Any, *, strict: bool, where: str = "schema") -> None:
    """Raise :class:`SchemaError` unless ``schema`` is a schema this service constrains answers with: within the
    limits, and with ``strict`` in OpenAI's strict subset (whose root is an object)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{where} must be a JSON object")
    if strict and schema.get("type") != "object":
        raise SchemaError(f"{where}: a strict schema's root must be of \"type\": \"object\"")
    count = _Count()
    for defs in ("$defs", "definitions"):
        if defs in schema:
            if not isinstance(schema[defs], dict):
                raise SchemaError(f"{where}/{defs} must be an object of schemas")
            for name, sub in schema[defs].items():
                _chars(count, str(name), where)
                _walk(sub, strict, f"{where}/{defs}/{name}", 1, count)
    _walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")}, strict, where, 1, count)


def _walk(schema: Any, strict: bool, where: str, depth: int, count: _Count) -> None:
    if isinstance(schema, bool) and not strict:
        return
    if not isinstance(schema, dict):
        raise SchemaError(f"{where} must be a JSON object (a schema)")
    count.nesting += 1
    try:
        _schema(schema, strict, where, depth, count)
    finally:
        count.nesting -= 1


def _schema(schema: dict[str, Any], strict: bool, where: str, depth: int, count: _Count) -> None:
    if count.nesting > MAX_NESTING:
        raise SchemaError(f"{where}: schemas nested more than {MAX_NESTING} deep")
    if strict:
        _strict_keywords(schema, where)
    types = schema.get("type")
    kinds = types if isinstance(types, list) else [types] if types is not None else []
    container = "properties" in schema or "items" in schema or any(k in ("object", "array") for k in kinds)
    if depth > MAX_DEPTH and container:
        raise SchemaError(f"{where}: more than {MAX_DEPTH} levels of nested objects and arrays")
    if strict and any(t not in TYPES for t in kinds):
        raise SchemaError(f"{where}/type must be one of {', '.join(TYPES)} (or a list of them)")
    if "enum" in schema:
        _enum(schema["enum"], where, count)
    if "const" in schema:
        _chars(count, schema["const"] if isinstance(schema["const"], str) else "", where)
    if schema.get("properties") is not None or "object" in kinds:
        _object(schema, strict, where, depth, count)
    for sub, at, deeper in _parts(schema, strict, where):
        _walk(sub, strict, at, depth + deeper, count)


def _parts(schema: dict[str, Any], strict: bool, where: str) -> Iterator[tuple[Any, str, int]]:
    """A schema's sub-schemas other than its properties: each with where it is and the levels it adds."""
    if "items" in schema:
        yield schema["items"], f"{where}/items", 1
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise SchemaError(f"{where}/{key} must be a non-empty list of schemas")
            for i, sub in enumerate(schema[key]):
                yield sub, f"{where}/{key}/{i}", 0
    if not strict:
        for key in ("not", "if", "then", "else", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                yield schema[key], f"{where}/{key}", 1


def _strict_keywords(schema: dict[str, Any], where: str) -> None:
    for key in schema:
        if key not in STRICT_KEYWORDS:
            raise SchemaError(f"{where}: the keyword '{key}' is not supported in a strict schema")
    if "format" in schema and (not isinstance(schema["format"], str) or schema["format"] not in FORMATS):
        raise SchemaError(f"{where}/format: '{schema['format']}' is not a supported format "
                          f"({', '.join(sorted(FORMATS))})")
    ref = schema.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
        raise SchemaError(f"{where}/$ref must point inside the schema ('#' or '#/$defs/...')")


def _object(schema: dict[str, Any], strict: bool, where: str, depth: int, count: _Count) -> None:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise SchemaError(f"{where}/properties must be an object of schemas")
    count.properties += len(props)
    if count.properties > MAX_PROPERTIES:
        raise SchemaError(f"{where}: more than {MAX_PROPERTIES} object properties in the schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaError(f"{where}/required must be a list of property names")
    if strict:
        if schema.get("additionalProperties") is not False:
            raise SchemaError(f"{where}: 'additionalProperties' must be false in a strict schema")
        missing = [name for name in props if name not in required]
        if missing:
            raise SchemaError(f"{where}/required must list every property in a strict schema (missing: "
                              f"{', '.join(missing[:5])}); make a field optional by a union with null")
        unknown = [name for name in required if name not in props]
        if unknown:
            raise SchemaError(f"{where}/required names '{unknown[0]}', which is not among its properties")
    for name, sub in props.items():
        _chars(count, name, where)
        _walk(sub, strict, f"{where}/properties/{name}", depth + 1, count)


def _enum(values: Any, where: str, count: _Count) -> None:
    if not isinstance(values, list) or not values:
        raise SchemaError(f"{where}/enum must be a non-empty list")
    count.enum_values += len(values)
    if count.enum_values > MAX_ENUM_VALUES:
        raise SchemaError(f"{where}/enum: more than {MAX_ENUM_VALUES} enum values in the schema")
    strings = sum(len(v) for v in values if isinstance(v, str))
    if len(values) > LARGE_ENUM and strings > LARGE_ENUM_CHARS:
        raise SchemaError(f"{where}/enum: an enum of more than {LARGE_ENUM} values may hold at most "
                          f"{LARGE_ENUM_CHARS} characters of strings")
    for v in values:
        _chars(count, v if isinstance(v, str) else str(v), where)


def _chars(count: _Count, text: str, where: str) -> None:
    count.chars += len(text)
    if count.chars > MAX_STRING_CHARS:
        raise SchemaError(f"{where}: more than {MAX_STRING_CHARS} characters of property names, definition "
                          "names and enum and const values in the schema")
