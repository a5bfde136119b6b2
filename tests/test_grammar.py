"""The grammar engine without a model: masks over a real byte-level BPE vocabulary (built here with the
``tokenizers`` library), the compile cache and its bounds, and sim-lm's constrained rows."""
from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import llguidance
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gpu_worker.backends.grammar import Grammars, RowGrammar, allowed_count, allows, nth_allowed
from gpu_worker.backends.interface import ItemError
from gpu_worker.backends.sim_lm import SimLMBackend
from gpu_worker.backends.sim_lm_text import EOS, TOKEN_BYTES
from tasks.schema import GenerationOutput, SamplingParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind", "boss"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
                         "kind": {"enum": ["staff", "contractor", "intern"]},
                         "boss": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/ref"}]}},
          "$defs": {"ref": {"type": "object", "additionalProperties": False, "required": ["id"],
                            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "lines", "status"],
         "properties": {"id": {"type": "string"}, "status": {"enum": ["open", "paid", "void"]},
                        "lines": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False, "required": ["sku", "qty", "note"],
                            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                           "note": {"type": ["string", "null"]}}}}}}
WEATHER: dict[str, Any] = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                           "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}
TOOL_CALL: dict[str, Any] = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER}}


def grammar(schema: dict[str, Any]) -> str:
    return "start: %json " + json.dumps(schema)


@pytest.fixture(scope="module")
def bpe() -> tuple[Tokenizer, int]:
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic, offline, a few hundred tokens)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"name": "ada lovelace", "age": 36, "tags": ["math", "poet"], "kind": "staff",
                          "boss": None, "id": i, "lines": [{"sku": "a1", "qty": 2, "note": "fragile"}]})
              for i in range(50)] + ["the quick brown fox jumps over the lazy dog"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    eos = tokenizer.token_to_id("<|eos|>")
    assert eos is not None
    return tokenizer, eos


@pytest.fixture(scope="module")
def grammars(bpe: tuple[Tokenizer, int]) -> Grammars:
    tokenizer, eos = bpe
    return Grammars(llguidance.LLTokenizer(tokenizer.to_str(), eos_token=eos), entries=3)


def random_walk(row: RowGrammar, rng: random.Random, whitespace: set[int], limit: int = 400) -> list[int]:
    """Random allowed tokens until the grammar is done: the end of sequence as soon as it is allowed, never a
    whitespace-only token when another is allowed (the schemas are bounded, so the walk ends)."""
    tokens: list[int] = []
    for _ in range(limit):
        mask = row.mask()
        if allows(mask, row.eos) or row.stopped:
            return tokens
        count = allowed_count(mask)
        choices = [t for t in (nth_allowed(mask, n) for n in range(count)) if t not in whitespace] or \
            [nth_allowed(mask, n) for n in range(count)]
        token = rng.choice(choices)
        assert row.consume(token), row.error
        tokens.append(token)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("schema", [PERSON, TOOL_CALL], ids=["person", "tool-call"])
def test_every_random_walk_of_allowed_tokens_parses_and_validates(bpe: tuple[Tokenizer, int], grammars: Grammars,
                                                                 schema: dict[str, Any]) -> None:
    tokenizer, _ = bpe
    whitespace = {i for i in range(tokenizer.get_vocab_size()) if not tokenizer.decode([i]).strip()}
    rng = random.Random(42)
    for _ in range(60):
        row = grammars.now(grammar(schema))
        assert isinstance(row, RowGrammar)
        text = tokenizer.decode(random_walk(row, rng, whitespace))
        jsonschema.validate(json.loads(text), schema)


def test_the_cache_compiles_a_grammar_once_and_keeps_the_most_recent(grammars: Grammars) -> None:
    first = [grammar({"type": "string", "maxLength": n}) for n in range(1, 5)]
    misses = grammars.misses
    assert grammars.compile(first[0]) is grammars.compile(first[0])  # one compilation, shared
    assert grammars.misses == misses + 1
    for text in first[1:]:
        grammars.compile(text).result(10)
    assert grammars.compile(first[-1]).done() and grammars.misses == misses + 4
    grammars.compile(first[0])  # evicted (3 entries): compiled anew
    assert grammars.misses == misses + 5


def test_a_bad_or_oversized_grammar_fails_its_row_with_a_clear_error(bpe: tuple[Tokenizer, int]) -> None:
    tokenizer, eos = bpe
    small = Grammars(llguidance.LLTokenizer(tokenizer.to_str(), eos_token=eos), max_chars=100)
    bad = small.now("start: foo(")
    assert isinstance(bad, ItemError) and bad.type == "invalid_request" and "does not compile" in bad.message
    assert isinstance(small.now("start: " + "x" * 200), ItemError)
    assert small.compile("start: foo(") is small.compile("start: foo(")  # a failure is cached too


def test_a_hostile_grammar_is_bounded_by_the_parser_limits(grammars: Grammars) -> None:
    """A lexer whose states blow up (a regex with a counted tail) errs within its fuel: that row fails, quickly."""
    row = grammars.now('start: /(a|b)*a(a|b){30}/ "c" /(a|b)*a(a|b){30}/')
    assert isinstance(row, RowGrammar)
    for _ in range(200):
        mask = row.mask()
        if row.error or not allowed_count(mask):
            break
        row.consume(nth_allowed(mask, 0))
    # either it finished within the limits or it says why it stopped; it never hangs
    assert row.error or row.stopped or allowed_count(row.mask()) > 0


# -- sim-lm ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim() -> Any:
    backend = SimLMBackend(speed=10_000)
    yield backend
    backend.close()


def test_sim_lm_constrained_rows_parse_and_validate_beside_free_ones(sim: SimLMBackend) -> None:
    schemas: list[dict[str, Any]] = [PERSON, ORDER, TOOL_CALL, {"type": "object"}]
    params = [SamplingParams(max_tokens=300, grammar=grammar(schemas[i % 4]), temperature=1.0, seed=i)
              for i in range(80)] + [SamplingParams(max_tokens=12, temperature=0)] * 20
    outputs = sim.run([f"extract record {i}" for i in range(100)], params)
    for i, out in enumerate(outputs[:80]):
        assert isinstance(out, GenerationOutput) and out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schemas[i % 4])
        assert out.completion_tokens < 200
    alone = sim.run(["extract record 80"], [SamplingParams(max_tokens=12, temperature=0)])
    assert outputs[80] == alone[0]  # a free row is unchanged by constrained ones beside it


def test_sim_lm_constrained_text_is_deterministic_and_cut_by_max_tokens(sim: SimLMBackend) -> None:
    p = SamplingParams(max_tokens=300, grammar=grammar(ORDER), temperature=0.7, seed=3)
    a, b = sim.run(["same prompt", "same prompt"], [p, p])
    assert a == b
    cut = sim.run(["same prompt"], [SamplingParams(max_tokens=5, grammar=grammar(ORDER), temperature=0.7, seed=3)])[0]
    assert isinstance(cut, GenerationOutput) and cut.finish_reason == "length" and cut.completion_tokens == 5


def test_sim_lm_a_bad_grammar_fails_its_row_alone(sim: SimLMBackend) -> None:
    free = SamplingParams(max_tokens=4, seed=11)  # seeded: an unseeded row may meet its random EOS early
    bad, good = sim.run(["a", "b"], [SamplingParams(grammar="start: foo("), free])
    assert isinstance(bad, ItemError) and bad.type == "invalid_request"
    assert isinstance(good, GenerationOutput) and good.completion_tokens >= 1
    assert good == sim.run(["b"], [free])[0]  # the healthy row answers as it would alone


def test_sim_lm_static_mode_constrains_too() -> None:
    static = SimLMBackend(mode="static", speed=10_000)
    out, bad = static.run(["x", "y"], [SamplingParams(max_tokens=300, grammar=grammar(TOOL_CALL)),
                                       SamplingParams(grammar="start: (")])
    assert isinstance(out, GenerationOutput)
    jsonschema.validate(json.loads(out.text), TOOL_CALL)
    assert isinstance(bad, ItemError)


def test_sim_lm_vocabulary_is_bytes_complete() -> None:
    assert {TOKEN_BYTES[i] for i in range(EOS) if len(TOKEN_BYTES[i]) == 1} >= {bytes([b]) for b in range(256)}


def test_sim_lm_logit_bias_and_penalties_steer_its_choice(sim: SimLMBackend) -> None:
    def text(**shaping: Any) -> str:
        out = sim.run(["steer me"], [SamplingParams(max_tokens=6, temperature=0, **shaping)])[0]
        assert isinstance(out, GenerationOutput)
        return out.text

    plain = text()
    assert text(logit_bias=((5, 100.0),)) == TOKEN_BYTES[5].decode() * 6
    # first, then 1.5 - 1 loses to a natural token not yet used (logit 1)
    repeated = text(logit_bias=((5, 1.5),), presence_penalty=1.0)
    assert repeated.startswith(TOKEN_BYTES[5].decode()) and repeated.count(TOKEN_BYTES[5].decode()) < 6
    first = plain.split(" ")[1]
    banned = [i for i in range(EOS) if TOKEN_BYTES[i] == (" " + first).encode()]
    assert not text(logit_bias=((banned[0], -100.0),)).startswith(" " + first + " ")


def test_sim_lm_reports_the_prompt_tokens_its_cache_held(sim: SimLMBackend) -> None:
    prompt = " ".join(f"word{i}" for i in range(64))
    first, = sim.run([prompt], [SamplingParams(max_tokens=2, temperature=0)])
    again, = sim.run([prompt + " more"], [SamplingParams(max_tokens=2, temperature=0)])
    assert isinstance(first, GenerationOutput) and isinstance(again, GenerationOutput)
    assert first.cached_tokens == 0 and again.cached_tokens >= 48 and again.cached_tokens % 16 == 0
    assert again.to_dict()["cached_tokens"] == again.cached_tokens


def test_sim_lm_renders_tools_and_tool_messages() -> None:
    from gpu_worker.backends.sim_lm import render_chat

    messages: list[dict[str, Any]] = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "x"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    rendered = render_chat(messages, [{"type": "function", "function": {"name": "get"}}])
    assert rendered.startswith('<|tools|>[{"type": "function"')
    assert '<|assistant|><tool_call>\n{"name": "get", "arguments": {"city": "x"}}\n</tool_call>\n' in rendered
    assert rendered.endswith("<|tool|>sunny\n<|assistant|>")
    assert render_chat([{"role": "user", "content": "hi"}]) == "<|user|>hi\n<|assistant|>"


def test_sim_lm_calls_a_tool_when_the_user_spoke_and_answers_a_tools_result(sim: SimLMBackend) -> None:
    """Under ``tool_choice: auto`` (text or calls), as an agent's model does: a call first, then an answer."""
    from tasks.policy.tool_calls import parse

    call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER}}
    auto = ('start: answer | call ("\\n" call)*\ncall: "<tool_call>\\n" %json ' + json.dumps(call) +
            ' "\\n</tool_call>"\nanswer: /[^<](.|\\n)*/ | ""')
    tools = ({"type": "function", "function": {"name": "get_weather"}},)
    asked: list[dict[str, Any]] = [{"role": "user", "content": "weather in Paris?"}]
    answered = [*asked, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    first, then = sim.run([json.dumps(asked), json.dumps(answered)],
                          [SamplingParams(max_tokens=300, grammar=auto, chat=True, tools=tools)] * 2)
    assert isinstance(first, GenerationOutput) and isinstance(then, GenerationOutput)
    calls = parse(first.text).calls
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert not parse(then.text).calls and then.text.strip()
