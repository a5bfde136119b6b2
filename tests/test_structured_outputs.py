"""Structured outputs without a model: the strict JSON-schema subset and its limits, the grammars built from
``response_format`` and ``tools`` (compiled by llguidance and run over a byte-level vocabulary built with
``tokenizers``), and the request fields and messages as the chat route reads them."""
from __future__ import annotations

import json
from functools import cache
from typing import Any

import llguidance
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tasks.errors import InvalidInput
from tasks.policy import json_schema
from tasks.policy.json_schema import SchemaError, check
from tasks.policy.output_grammar import Function, json_grammar, tools_grammar
from tasks.schema import ItemResult
from webapp.openai_schema import chat_response
from webapp.openai_tools import chat_messages, constraint

EOS = "<|eos|>"


@cache
def tokenizer() -> tuple[Tokenizer, llguidance.LLTokenizer]:
    """One token per byte, and an end-of-sequence token: every text has exactly one tokenization."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok, llguidance.LLTokenizer(tok.to_str(), eos_token=vocab[EOS])


def accepts(grammar: str, text: str) -> bool:
    """Whether a model constrained by ``grammar`` may write ``text`` and stop there."""
    tok, lltok = tokenizer()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and matcher.is_accepting()


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": ["integer", "null"]},
                         "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "$defs": {"Pet": {"type": "object", "additionalProperties": False, "required": ["kind"],
                            "properties": {"kind": {"type": "string", "enum": ["cat", "dog"]}}}}}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"], "additionalProperties": False}
    return schema


# -- the checker ---------------------------------------------------------------------------------------------
def test_a_strict_schema_in_the_subset_passes() -> None:
    check(PERSON, strict=True)
    check(nested(json_schema.MAX_DEPTH), strict=True)


@pytest.mark.parametrize(("change", "named"), [
    (lambda s: s.pop("additionalProperties"), "additionalProperties"),
    (lambda s: s["required"].remove("age"), "missing: age"),
    (lambda s: s["properties"]["name"].update(minLength=1), "'minLength'"),
    (lambda s: s.update(allOf=[{"type": "object"}]), "'allOf'"),
    (lambda s: s["properties"]["name"].update(format="color"), "format"),
    (lambda s: s["properties"]["age"].update(type="float"), "type must be one of"),
    (lambda s: s["$defs"]["Pet"].pop("additionalProperties"), "$defs/Pet"),
])
def test_a_strict_schema_outside_the_subset_is_refused_naming_the_keyword(change: Any, named: str) -> None:
    schema = json.loads(json.dumps(PERSON))
    change(schema)
    with pytest.raises(SchemaError, match=named.replace("$", r"\$")):
        check(schema, strict=True)


def test_a_strict_root_is_an_object() -> None:
    with pytest.raises(SchemaError, match="root"):
        check({"type": "array", "items": {"type": "string"}}, strict=True)


def test_the_limits_are_openais() -> None:
    with pytest.raises(SchemaError, match="levels of nested objects"):
        check(nested(json_schema.MAX_DEPTH + 1), strict=False)
    many = {f"p{i}": {"type": "string"} for i in range(json_schema.MAX_PROPERTIES + 1)}
    with pytest.raises(SchemaError, match="5000 object properties"):
        check({"type": "object", "properties": many}, strict=False)
    with pytest.raises(SchemaError, match="1000 enum values"):
        check({"type": "object", "properties": {"e": {"enum": list(range(1001))}}}, strict=False)
    with pytest.raises(SchemaError, match="15000 characters"):
        check({"enum": ["x" * 100] * 251}, strict=False)
    long_names = {"x" * 60_000 + str(i): {"type": "string"} for i in range(3)}
    with pytest.raises(SchemaError, match="120000 characters"):
        check({"type": "object", "properties": long_names}, strict=False)


def test_a_schema_that_is_not_strict_may_use_more_of_json_schema() -> None:
    check({"type": "object", "properties": {"a": {"type": "string", "minLength": 2}},
           "allOf": [{"required": ["a"]}]}, strict=False)


# -- the grammars --------------------------------------------------------------------------------------------
def test_a_json_schema_grammar_accepts_valid_compact_json_only() -> None:
    grammar = json_grammar(PERSON)
    assert accepts(grammar, '{"name": "Ann", "age": null, "pet": {"kind": "cat"}, "tags": ["a"]}')
    assert not accepts(grammar, '{"name": "Ann", "age": 3, "pet": {"kind": "cow"}, "tags": []}')
    assert not accepts(grammar, '{"name": "Ann", "age": 3, "pet": null}')  # tags missing
    assert not accepts(grammar, '{"name":  "Ann", "age": 3, "pet": null, "tags": []}')  # padded


WEATHER = Function("weather", {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                               "required": ["city"], "additionalProperties": False,
                               "$defs": {"City": {"type": "string", "enum": ["Paris", "Oslo"]}}})
TIME = Function("time", {"type": "object", "properties": {}})


def call(name: str, arguments: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_a_required_tool_grammar_writes_calls_to_the_tools_only() -> None:
    grammar = tools_grammar((WEATHER, TIME), required=True, parallel=True)
    assert accepts(grammar, call("weather", {"city": "Oslo"}))
    assert accepts(grammar, call("weather", {"city": "Oslo"}) + "\n" + call("time", {}))
    assert not accepts(grammar, call("weather", {"city": "Rome"}))  # the $ref still points at City
    assert not accepts(grammar, call("search", {}))
    assert not accepts(grammar, "It is sunny.")
    single = tools_grammar((WEATHER, TIME), required=True, parallel=False)
    assert accepts(single, call("time", {}))
    assert not accepts(single, call("time", {}) + "\n" + call("time", {}))


def test_an_auto_tool_grammar_writes_text_or_calls() -> None:
    grammar = tools_grammar((WEATHER,), required=False, parallel=True)
    assert accepts(grammar, "It is sunny.")
    assert not accepts(grammar, "")  # an answer, or a call
    assert accepts(grammar, call("weather", {"city": "Paris"}))
    assert not accepts(grammar, "<tool_call>\n{\"name\": \"weather\"}\n</tool_call>")
    with_format = tools_grammar((WEATHER,), required=False, parallel=True, answer={"type": "object"})
    assert accepts(with_format, '{"ok": true}')
    assert not accepts(with_format, "It is sunny.")


# -- the request fields --------------------------------------------------------------------------------------
def schema_format(schema: Any, strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


def test_response_format_becomes_a_grammar() -> None:
    assert constraint({}, chat=True) == (None, ())
    assert constraint({"response_format": {"type": "text"}}, chat=True) == (None, ())
    grammar, _ = constraint({"response_format": {"type": "json_object"}}, chat=True)
    assert grammar is not None and accepts(grammar, '{"a": [1, 2]}') and not accepts(grammar, "[1]")
    grammar, _ = constraint({"response_format": schema_format(PERSON)}, chat=False)
    assert grammar == json_grammar(PERSON)


@pytest.mark.parametrize(("body", "named"), [
    ({"response_format": schema_format({**PERSON, "patternProperties": {}})}, "'patternProperties'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "'name'"),
    ({"response_format": {"type": "xml"}}, "'response_format'"),
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, False)},
     "cannot be compiled"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                   "parameters": {"type": "object", "properties": {}}}}]},
     "additionalProperties"),
    ({"tools": [{"type": "code_interpreter"}]}, "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "g"}}},
     "'g'"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
])
def test_a_bad_structured_output_field_is_a_400_naming_it(body: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInput, match=named):
        constraint(body, chat=True)


def test_tools_on_completions_are_a_400() -> None:
    with pytest.raises(InvalidInput, match="/v1/chat/completions"):
        constraint({"tools": [{"type": "function", "function": {"name": "f"}}]}, chat=False)


def test_tool_choice_picks_the_grammar_and_none_shows_no_tools() -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("a", "b")]
    grammar, shown = constraint({"tools": tools}, chat=True)
    assert shown == tuple(tools) and grammar is not None and accepts(grammar, "hi")
    grammar, _ = constraint({"tools": tools, "tool_choice": "required"}, chat=True)
    assert grammar is not None and accepts(grammar, call("b", {})) and not accepts(grammar, "hi")
    grammar, _ = constraint({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "a"}}},
                            chat=True)
    assert grammar is not None and accepts(grammar, call("a", {})) and not accepts(grammar, call("b", {}))
    assert constraint({"tools": tools, "tool_choice": "none"}, chat=True) == (None, ())


def test_a_tool_loops_messages_pass_through() -> None:
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                                      "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert chat_messages(messages) == [{"role": "system", "content": "Be brief"}, messages[1], messages[2],
                                       messages[3]]
    for bad in ({"role": "tool", "content": "x"}, {"role": "assistant", "content": None},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]},
                {"role": "robot", "content": "x"}):
        with pytest.raises(InvalidInput, match=r"messages\[0\]"):
            chat_messages([bad])


def test_an_answer_with_calls_has_tool_calls_and_finish_reason_tool_calls() -> None:
    text = call("weather", {"city": "Oslo"}) + "\n" + call("time", {})
    results = (ItemResult(output={"text": text, "finish_reason": "stop"}),
               ItemResult(output={"text": call("time", {}), "finish_reason": "length"}),
               ItemResult(output={"text": "Just text.", "finish_reason": "stop"}))
    choices = chat_response("r", "m", results, tools=True)["choices"]
    first = choices[0]["message"]
    assert first["content"] is None and choices[0]["finish_reason"] == "tool_calls"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first["tool_calls"]] \
        == [("function", "weather", {"city": "Oslo"}), ("function", "time", {})]
    assert len({c["id"] for c in first["tool_calls"]}) == 2
    assert choices[1]["finish_reason"] == "length"
    assert choices[2]["message"] == {"role": "assistant", "content": "Just text."}
    assert chat_response("r", "m", results[:1])["choices"][0]["message"]["content"] == text  # no tools: text


def test_a_deep_union_or_an_odd_value_is_a_clear_error_not_a_crash() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"anyOf": [deep, {"type": "null"}]}
    with pytest.raises(SchemaError, match="nested more than"):
        check({"type": "object", "properties": {"a": deep}}, strict=False)
    with pytest.raises(SchemaError, match="format"):
        check({"type": "object", "properties": {"a": {"type": "string", "format": ["x"]}}, "required": ["a"],
               "additionalProperties": False}, strict=True)


def test_a_flood_of_distinct_schemas_cannot_grow_the_checked_grammars_past_their_bound() -> None:
    from webapp import openai_tools

    def body(i: int, pad: int = 0) -> dict[str, Any]:
        schema = {"type": "object", "additionalProperties": False, "required": [f"k{i}"],
                  "properties": {f"k{i}": {"type": "string", "description": "x" * pad}}}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}

    for i in range(400):
        constraint(body(i), chat=True)
    assert openai_tools._checked_cached.cache_info().currsize <= 256
    before = openai_tools._checked_cached.cache_info().currsize
    grammar, _ = constraint(body(1000, pad=openai_tools.CACHED_GRAMMAR_CHARS), chat=True)
    assert grammar is not None and len(grammar) > openai_tools.CACHED_GRAMMAR_CHARS
    assert openai_tools._checked_cached.cache_info().currsize == before  # checked, not kept
