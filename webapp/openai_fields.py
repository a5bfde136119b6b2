"""Every field of OpenAI's chat-completions and completions requests, and what this service does with it (pure).

A field is *honoured* (it does here what it does at OpenAI), *accepted* (it carries no behaviour here, and says
so in docs/api.md: ``user``, ``metadata``, ``safety_identifier``, ``store``) or *refused* with a 400 that names
it and says why. A field the table does not know (a typo, a field of a newer API) is a 400 naming it too: a
client never gets an answer that quietly left out what it asked for. ``null`` is as absent, as at OpenAI.

The table gives the accepted values of the fields it checks itself (as JSON Schema: the same schema is in
``/openapi.json``, :mod:`webapp.openapi`); the other honoured fields are checked where they are parsed
(:mod:`webapp.openai_schema`), and the structured-output fields (``response_format``, ``tools``...) where their
grammar is built.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tasks.errors import InvalidInput
from tasks.schema import Priority, bounds

Schema = dict[str, Any]
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI limits it
CHAT, COMPLETIONS = "chat", "completions"
BOTH = frozenset({CHAT, COMPLETIONS})
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


class Handling(StrEnum):
    HONOURED = "honoured"
    ACCEPTED = "accepted, no behaviour here"
    REFUSED = "refused (400)"


@dataclass(frozen=True)
class Field:
    """One request field: how it is handled, what it does here (or why it is refused), on which routes, and
    the values the table checks (``schema``, said in words by ``expect``). A refused field with a ``schema``
    accepts the values that ask for nothing beyond what happens anyway (``modalities: ["text"]``)."""

    handling: Handling
    note: str
    routes: frozenset[str] = BOTH
    schema: Schema | None = None
    expect: str = ""


def _number(name: str) -> Schema:
    return {"type": "number", **bounds(name)}


def _text(most: int) -> Schema:
    return {"type": "string", "maxLength": most}


H, A, R = Handling.HONOURED, Handling.ACCEPTED, Handling.REFUSED
TIERS = ("auto", "default", "flex", "priority", "fast")  # "fast": OpenAI's other name for "priority"
METADATA: Schema = {"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                    "additionalProperties": {"type": "string", "maxLength": 512}}
LOGIT_BIAS: Schema = {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                      "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                      "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
FIELDS: dict[str, Field] = {
    # what to generate from
    "model": Field(H, "the model, or a LoRA adapter of one (GET /v1/models lists those the caller may use)"),
    "messages": Field(H, "the conversation, rendered by the model's chat template", frozenset({CHAT})),
    "prompt": Field(H, "one prompt or a list (one item each; token ids are refused)", frozenset({COMPLETIONS})),
    # sampling
    "max_tokens": Field(H, "output tokens at most (up to LLMB_MAX_TOKENS_CAP)"),
    "max_completion_tokens": Field(H, "as max_tokens (wins over it)"),
    "temperature": Field(H, "sampling temperature, 0 to 2 (0: greedy)"),
    "top_p": Field(H, "nucleus sampling"),
    "stop": Field(H, "up to 4 stop strings"),
    "seed": Field(H, "reproducible sampling; choice j of n samples with seed + j"),
    "n": Field(H, "choices per prompt, up to 16 (each an item of the call)"),
    "presence_penalty": Field(H, "applied to each step's logits, as OpenAI defines it", schema=_number(
        "presence_penalty"), expect="a number from -2 to 2"),
    "frequency_penalty": Field(H, "applied to each step's logits, as OpenAI defines it", schema=_number(
        "frequency_penalty"), expect="a number from -2 to 2"),
    "logit_bias": Field(H, "added to the logits of the token ids given (the model's tokenizer's ids)",
                        schema=LOGIT_BIAS, expect=f"an object of at most {MAX_LOGIT_BIAS} token ids (strings of "
                        "digits) to numbers from -100 to 100"),
    "logprobs": Field(H, "log-probabilities of the tokens (chat: true/false; completions: 0 to 5 alternatives)"),
    "top_logprobs": Field(H, "alternatives per token, 0 to 20 (with logprobs: true)", frozenset({CHAT})),
    "echo": Field(H, "the prompt before its completion, with its logprobs (max_tokens 0: scoring a text)",
                  frozenset({COMPLETIONS})),
    # structured outputs and tools
    # (their types here; what is inside them is checked where their grammar is built)
    "response_format": Field(H, "text, json_object or json_schema: decoding constrained by a grammar",
                             schema={"type": "object"}, expect="an object"),
    "tools": Field(H, "function tools: calls constrained by a grammar, answered in message.tool_calls",
                   frozenset({CHAT}), schema={"type": "array", "items": {"type": "object"}},
                   expect="a list of objects"),
    "tool_choice": Field(H, "none, auto, required or a named function", frozenset({CHAT}),
                         schema={"anyOf": [{"type": "string"}, {"type": "object"}]}, expect="a string or an object"),
    "parallel_tool_calls": Field(H, "whether one answer may hold several calls", frozenset({CHAT}),
                                 schema={"type": "boolean"}, expect="true or false"),
    # streaming
    "stream": Field(H, "server-sent events, resumable (GET /v1/requests/{id}/stream)"),
    "stream_options": Field(H, "include_usage: a last chunk with the counts"),
    # routing and priority
    "service_tier": Field(H, "auto, default and priority: interactive; flex: offline priority; echoed in "
                             "the answer as the tier that served it", schema={"enum": list(TIERS)},
                          expect="'auto', 'default', 'flex' or 'priority'"),
    "prompt_cache_key": Field(H, "a routing hint: calls with the same key and prompt start go to the worker "
                                 "whose prefix cache holds it", schema=_text(1024), expect="a string of at most "
                                 "1024 characters"),
    "prompt_cache_retention": Field(H, "in_memory: the workers' prefix caches, least recently used evicted "
                                       "(24h cannot be promised: refused)", frozenset({CHAT}),
                                    schema={"const": "in_memory"}, expect="'in_memory' (24h is not offered here)"),
    # accepted, no behaviour here
    "user": Field(A, "an end-user id; not stored or used here", schema={"type": "string"}, expect="a string"),
    "safety_identifier": Field(A, "an end-user id for abuse detection; not stored or used here",
                               frozenset({CHAT}), schema=_text(128), expect="a string of at most 128 characters"),
    "metadata": Field(A, "tags for stored completions; nothing is stored here", frozenset({CHAT}), schema=METADATA,
                      expect="an object of at most 16 string values (keys up to 64 characters, values up to 512)"),
    "store": Field(A, "OpenAI's stored completions (evals, distillation); chat answers are not stored here (the "
                      "call's record is kept for GET /v1/requests/{id} whatever it says)", frozenset({CHAT}),
                   schema={"type": "boolean"}, expect="true or false"),
    # refused
    "audio": Field(R, "audio output: the models served here write text", frozenset({CHAT})),
    "modalities": Field(R, "only text output; [\"text\"] is accepted", frozenset({CHAT}),
                        schema={"const": ["text"]}),
    "functions": Field(R, "deprecated by OpenAI: send 'tools'", frozenset({CHAT})),
    "function_call": Field(R, "deprecated by OpenAI: send 'tool_choice'", frozenset({CHAT})),
    "prediction": Field(R, "predicted outputs (speculative decoding from a given text) are not offered",
                        frozenset({CHAT})),
    "reasoning_effort": Field(R, "the models served here do not reason separately", frozenset({CHAT})),
    "verbosity": Field(R, "no model served here takes a verbosity", frozenset({CHAT})),
    "web_search_options": Field(R, "no web search here", frozenset({CHAT})),
    "moderation": Field(R, "no moderation here", frozenset({CHAT})),
    "prompt_cache_options": Field(R, "explicit cache breakpoints are not offered: the prefix cache is automatic",
                                  frozenset({CHAT})),
    "best_of": Field(R, "server-side best-of is not offered: ask for n choices with logprobs; 1 is accepted",
                     frozenset({COMPLETIONS}), schema={"const": 1}),
    "suffix": Field(R, "insertion (text after the completion) is not offered", frozenset({COMPLETIONS})),
    # this service's own
    "timeout_ms": Field(H, "this service's own: the call's deadline in milliseconds"),
    "priority": Field(H, "this service's own: interactive or offline (as service_tier flex)",
                      schema={"enum": [p.value for p in Priority]}, expect="'interactive' or 'offline'"),
}


def check(body: dict[str, Any], route: str) -> None:
    """Refuse (InvalidInput naming it) the first field of the body, in the body's order, that is unknown on
    ``route``, refused, or outside the values the table states; the honoured fields it does not state are
    checked where they are parsed."""
    for name, value in body.items():
        spec = FIELDS.get(name)
        if spec is None:
            raise InvalidInput(f"unknown field '{name}': {PATHS[route]} does not take it (docs/api.md lists the "
                               "fields it takes)")
        if value is None:
            continue
        if route not in spec.routes:
            raise InvalidInput(f"'{name}' is a {PATHS[next(iter(spec.routes))]} parameter")
        if spec.schema is not None and _valid(value, spec.schema):
            continue
        if spec.handling == R:
            raise InvalidInput(f"'{name}' is not supported here: {spec.note}")
        if spec.schema is not None:
            raise InvalidInput(f"'{name}' must be {spec.expect}")


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~tasks.schema.SamplingParams` fields of a body :func:`check` passed (defaults left out)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            out[name] = float(body[name])
    if body.get("logit_bias"):
        out["logit_bias"] = tuple(sorted((int(token), float(bias)) for token, bias in body["logit_bias"].items()))
    if body.get("prompt_cache_key"):
        out["prompt_cache_key"] = body["prompt_cache_key"]
    return out


def served_tier(body: Any, priority: Priority) -> str:
    """The ``service_tier`` an answer says (the tier that served it, as OpenAI's answers say), or "" when the
    body gave none: ``flex`` for an offline call (asked, or its tenant's class), ``priority`` when asked,
    ``default`` otherwise."""
    asked = body.get("service_tier") if isinstance(body, dict) else None
    if not isinstance(asked, str):
        return ""
    if priority == Priority.OFFLINE:
        return "flex"
    return "priority" if asked in ("priority", "fast") else "default"


def _valid(value: Any, schema: Schema) -> bool:
    """Whether ``value`` is valid against the JSON Schema subset the table uses."""
    if not schema:  # {}: anything
        return True
    if "const" in schema:  # (1.0 is 1, as JSON counts it; true is not)
        return bool(value == schema["const"]) and isinstance(value, bool) == isinstance(schema["const"], bool)
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_valid(value, option) for option in schema["anyOf"])
    kind = schema.get("type")
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        # (a pattern's "$" as JSON Schema's: the very end, not before a last newline as Python's)
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)) \
            and re.search(re.sub(r"\$$", r"\\Z", schema.get("pattern", "")), value) is not None
    if kind == "array":
        return isinstance(value, list) and all(_valid(v, schema["items"]) for v in value)
    if kind == "object":
        names, values = schema.get("propertyNames", {}), schema.get("additionalProperties", {})
        return isinstance(value, dict) and len(value) <= schema.get("maxProperties", len(value)) \
            and all(_valid(k, {"type": "string", **names}) and _valid(v, values) for k, v in value.items())
    raise ValueError(f"a schema the table does not use: {schema}")  # a bug in the table, not a bad request
