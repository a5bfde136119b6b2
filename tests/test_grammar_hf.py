"""hf-causal's continuous engine constrains rows by their grammar and honours penalties and logit bias, beside free
rows in one batch, with the tiny random model (its text is arbitrary: what is asserted is the shape)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpu_worker.backends.interface import ItemError
from harness.models import build_tiny_llama
from tasks.schema import GenerationOutput, SamplingParams

COMPACT = {"whitespace_flexible": False}  # a random model would otherwise write whitespace without end
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "additionalProperties": False, "required": ["kind", "n", "ok"], "x-guidance": COMPACT,
     "properties": {"kind": {"enum": ["cat", "mat"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                    "ok": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["tags", "note"], "x-guidance": COMPACT,
     "properties": {"tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}},
                    "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]}}},
]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    folder = build_tiny_llama(Path(tmp_path_factory.mktemp("grammar")) / "m")
    b = HFCausalBackend("tiny", str(folder), "cpu", 100, 256, continuous=EngineConfig())
    yield b
    b.close()


def test_constrained_rows_parse_and_validate_beside_free_ones(backend: Any) -> None:
    params = [SamplingParams(max_tokens=120, grammar="start: %json " + json.dumps(SCHEMAS[i % 2]),
                             temperature=1.0, seed=i) for i in range(12)]
    free = SamplingParams(max_tokens=8, temperature=0)
    outputs = backend.run([f"the cat {i}" for i in range(12)] + ["the mat"], [*params, free])
    for i, out in enumerate(outputs[:12]):
        assert isinstance(out, GenerationOutput) and out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % 2])
    assert outputs[12] == backend.run(["the mat"], [free])[0]  # a free row is unchanged beside them


def test_a_bad_grammar_fails_its_row_alone(backend: Any) -> None:
    # the good row is greedy with its end-of-text token banned, so it runs to its max_tokens whatever the weights
    eos = backend.tokenizer.eos_token_id
    good_params = SamplingParams(max_tokens=3, temperature=0, logit_bias=((eos, -100.0),) if eos is not None else ())
    bad, good = backend.run(["a", "b"], [SamplingParams(grammar="start: ("), good_params])
    assert isinstance(bad, ItemError) and bad.type == "invalid_request"
    assert isinstance(good, GenerationOutput) and good.completion_tokens == 3


def test_logit_bias_and_penalties_change_the_greedy_choice(backend: Any) -> None:
    def greedy(max_tokens: int, **shaping: Any) -> str:
        out = backend.run(["the cat sat"], [SamplingParams(max_tokens=max_tokens, temperature=0, **shaping)])[0]
        assert isinstance(out, GenerationOutput)
        return str(out.text)

    forced = greedy(4, logit_bias=((7, 100.0),))
    assert forced == backend.tokenizer.decode([7] * 4)
    assert greedy(4, logit_bias=((7, 100.0),), frequency_penalty=2.0, presence_penalty=2.0) == forced
    alternating = greedy(4, logit_bias=((7, 100.0), (8, 100.0)), frequency_penalty=2.0)
    # each step, the token used more is penalised below the other
    assert alternating in (backend.tokenizer.decode([7, 8, 7, 8]), backend.tokenizer.decode([8, 7, 8, 7]))
    assert greedy(4, logit_bias=((7, 100.0), (8, 99.0))) == forced  # the larger bias wins
    assert greedy(4, logit_bias=((7, -100.0), (8, 99.0))) == backend.tokenizer.decode([8] * 4)


def test_tool_messages_reach_the_chat_template(backend: Any) -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "x"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = backend.prompt_text(json.dumps(messages), SamplingParams(chat=True))
    assert "<|assistant|>" in prompt and "<|tool|>sunny" in prompt


def test_static_mode_biases_rows_and_refuses_grammars(tmp_path: Path) -> None:
    from gpu_worker.backends.hf_causal import HFCausalBackend

    static = HFCausalBackend("tiny", str(build_tiny_llama(tmp_path / "m")), "cpu", 100, 256)
    refused, forced, free = static.run(["a", "b", "c"], [
        SamplingParams(grammar="start: %json {}"), SamplingParams(max_tokens=3, temperature=0, logit_bias=((7, 100),)),
        SamplingParams(max_tokens=3, temperature=0)])
    assert isinstance(refused, ItemError) and "static mode" in refused.message
    assert isinstance(forced, GenerationOutput) and forced.text == static.tokenizer.decode([7] * 3)
    assert isinstance(free, GenerationOutput) and free.text != forced.text


def test_a_padded_rows_stale_argument_is_read_as_free() -> None:
    """transformers pads a step's sequences and leaves the padding's logits-processor arguments from an earlier
    step: a slot past the rows prepared for this step must add nothing (it once raised IndexError, which ended
    the engine's generation loop under 100 constrained rows at once)."""
    import torch

    from gpu_worker.backends.generation import Row
    from gpu_worker.backends.row_logits import RowShaping, Shaping

    def future(request_id: str) -> Any:
        state = type("State", (), {"request_id": request_id, "_true_initial_tokens": 1, "initial_tokens": [5],
                                   "generated_tokens": []})()
        return type("Future", (), {"state": state})()

    shaping = RowShaping(vocab=4)
    shaping.add("biased", Shaping(Row.from_params(0, [5], SamplingParams(logit_bias=((2, 5.0),))), None))
    args = shaping.prepare_tensor_args([future("free"), future("biased")])
    stale = torch.cat([args, torch.tensor([7], dtype=torch.int32)])  # a padded row's argument from an earlier step
    out = shaping(torch.zeros(3, 4), stale)
    assert out.tolist() == [[0.0] * 4, [0.0, 0.0, 5.0, 0.0], [0.0] * 4]
