"""What constrained decoding costs on sim-lm: per-row mask time, compile time, throughput and the latency of free rows.

    python -m bench.constrained                 # about a minute on 2 cores; a Markdown table on stdout
    python -m bench.constrained --json report.json --outputs 1000
    python -m bench.constrained --hf            # also hf-causal's continuous engine, the tests' tiny model (CPU)

In process, no stack: the sim-lm backend (continuous batching, Llama-2-7B on an A100 timing, real clock) with its
byte-level vocabulary (11,680 tokens: its words with and without their space, JSON and tool-call pieces, 256
bytes, EOS), and llguidance grammars (``start: %json <schema>``) over :data:`SCHEMAS`, 24 realistic ones (nested
objects, arrays of objects, enums, unions with null, ``$ref``).

- compile: each schema's grammar compiled cold (a fresh cache per schema: llguidance's lexer and parser built)
  and cached (the compile cache's hit, plus the row's copy of the matcher), p50/p99 over the schemas;
- validity: ``--outputs`` constrained outputs (the schemas in turn, seeded) parsed and validated with jsonschema;
- mask: every ``compute_bitmask`` of those rows timed (the per-row, per-token cost inside a step), p50/p99/max;
- throughput: four batches of ``--rows`` rows at once (the worker's slots) with 0%, 50% and 100% of each
  constrained: output tokens/s, the mean latency of the unconstrained rows beside the constrained ones (the same
  free rows, same text, in each), and the wall time over the simulated device time of the steps run (the masks'
  cost shows as a ratio above 1). Every row has ``max_tokens`` 64 here, so that a batch lasts as long whatever
  its share; the tokens/s still move with how long the constrained answers are (the model's doing, not the
  mask's);
- ``--hf``: the same throughput runs on hf-causal's continuous engine with the tests' tiny random Llama on the
  CPU (its own tokenizer's vocabulary, so its own grammars): tokens/s only (its engine answers a batch's rows
  together, so there is no free row's own latency to read, and no device time: the steps are the CPU's own).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import jsonschema

from gpu_worker.backends.grammar import Grammars, RowGrammar
from gpu_worker.backends.interface import Hooks
from gpu_worker.backends.sim_lm import SimLMBackend
from gpu_worker.backends.sim_lm_grammar import sim_grammars
from harness.stats import percentile
from tasks.schema import GenerationOutput, SamplingParams


def _obj(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A strict object: every property required, no others (OpenAI's strict subset)."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **extra}


S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
NULLABLE_S = {"anyOf": [S, {"type": "null"}]}
ADDRESS = _obj({"street": S, "city": S, "zip": S, "country": {"enum": ["US", "GB", "FR", "DE", "JP"]}})
SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": S, "age": INT, "email": NULLABLE_S}),
    _obj({"title": S, "year": INT, "genres": {"type": "array", "items": S}, "rating": N}),
    _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": N}),
    _obj({"person": _obj({"name": S, "address": ADDRESS}), "verified": B}),
    _obj({"items": {"type": "array", "items": _obj({"sku": S, "qty": INT, "price": N})}, "total": N}),
    _obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    _obj({"query": S, "filters": {"type": "array", "items": _obj({"field": S, "op": {"enum": ["eq", "lt", "gt"]},
                                                                  "value": {"anyOf": [S, N, {"type": "null"}]}})}}),
    _obj({"event": S, "start": S, "end": NULLABLE_S, "attendees": {"type": "array", "items": S}}),
    _obj({"invoice": S, "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}}, "paid": B},
         **{"$defs": {"line": _obj({"desc": S, "amount": N, "tax": {"anyOf": [N, {"type": "null"}]}})}}),
    _obj({"tree": {"$ref": "#/$defs/node"}},
         **{"$defs": {"node": _obj({"label": S, "children": {"type": "array", "items": _obj({"label": S})}})}}),
    _obj({"answer": S, "citations": {"type": "array", "items": _obj({"source": S,
                                                                      "page": {"anyOf": [INT, {"type": "null"}]}})}}),
    _obj({"steps": {"type": "array", "items": _obj({"explanation": S, "output": S})}, "final_answer": S}),
    _obj({"entities": {"type": "array", "items": _obj({"text": S, "type": {"enum": ["PER", "ORG", "LOC", "MISC"]}})}}),
    _obj({"language": {"enum": ["en", "fr", "de", "es", "it", "ja", "zh"]}, "translation": S}),
    _obj({"summary": S, "keywords": {"type": "array", "items": S}, "tone": {"enum": ["formal", "casual"]}}),
    _obj({"user": _obj({"id": INT, "name": S, "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}}}),
          "active": B}),
    _obj({"product": S, "price": _obj({"amount": N, "currency": {"enum": ["USD", "EUR", "GBP"]}}), "stock": INT}),
    _obj({"ticket": _obj({"priority": {"enum": ["low", "medium", "high"]}, "assignee": NULLABLE_S,
                          "labels": {"type": "array", "items": S}}), "due": NULLABLE_S}),
    _obj({"name": {"const": "get_weather"}, "arguments": _obj({"location": S, "unit": {"enum": ["c", "f"]}})}),
    _obj({"name": {"const": "search"}, "arguments": _obj({"q": S, "limit": INT, "safe": B})}),
    _obj({"rows": {"type": "array", "items": _obj({"a": INT, "b": INT, "c": NULLABLE_S})}}),
    _obj({"recipe": S, "ingredients": {"type": "array", "items": _obj({"name": S, "grams": N})},
          "vegan": B, "minutes": INT}),
    _obj({"company": _obj({"name": S, "hq": ADDRESS, "employees": INT}), "ceo": _obj({"name": S, "since": INT})}),
    _obj({"classification": {"anyOf": [_obj({"kind": {"const": "spam"}, "score": N}),
                                       _obj({"kind": {"const": "ham"}, "reason": S})]}}),
]


def grammar(schema: dict[str, Any]) -> str:
    return "start: %json " + json.dumps(schema)


def compile_times(grammars_for: Callable[[], Grammars]) -> tuple[list[float], list[float]]:
    """Milliseconds per schema to compile it cold (a fresh cache) and to get a row's matcher from the cache."""
    cold, cached = [], []
    for schema in SCHEMAS:
        fresh = grammars_for()
        started = time.perf_counter()
        fresh.now(grammar(schema))
        cold.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        fresh.now(grammar(schema))
        cached.append((time.perf_counter() - started) * 1000)
        fresh.close()
    return cold, cached


def timed_masks() -> list[float]:
    """Record every mask's time (microseconds) from now on."""
    times: list[float] = []
    plain = RowGrammar.mask

    def mask(self: RowGrammar) -> bytes:
        started = time.perf_counter()
        out = plain(self)
        times.append((time.perf_counter() - started) * 1e6)
        return out

    RowGrammar.mask = mask  # type: ignore[method-assign]
    return times


def validity(backend: SimLMBackend, outputs: int, rows: int) -> tuple[int, int, int]:
    """Constrained outputs generated, those valid, and those cut by max_tokens."""
    valid = cut = 0
    for start in range(0, outputs, rows):
        n = min(rows, outputs - start)
        params = [SamplingParams(max_tokens=600, grammar=grammar(SCHEMAS[(start + i) % len(SCHEMAS)]),
                                 temperature=1.0, seed=start + i) for i in range(n)]
        for i, out in enumerate(backend.run([f"extract record {start + i}" for i in range(n)], params)):
            if not isinstance(out, GenerationOutput):
                continue
            cut += out.finish_reason == "length"
            try:
                jsonschema.validate(json.loads(out.text), SCHEMAS[(start + i) % len(SCHEMAS)])
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return outputs, valid, cut


def throughput(backend: Any, rows: int, share: float, batches: int = 4) -> dict[str, float]:
    """``batches`` batches of ``rows`` rows at once (the worker's slots), ``share`` of each constrained: output
    tokens/s, the free rows' mean latency, and the engine's wall time per step over the simulated device's
    (above 1: the masks made the steps longer than the device would)."""
    constrained = int(rows * share)
    # the same budget for every row, so that the batch's length is not the constrained answers' longest
    params = [SamplingParams(max_tokens=64, grammar=grammar(SCHEMAS[i % len(SCHEMAS)]), temperature=1.0, seed=i)
              for i in range(constrained)]
    params += [SamplingParams(max_tokens=64, temperature=0)] * (rows - constrained)
    simulated: list[float] = []
    sim = isinstance(backend, SimLMBackend)  # only sim-lm's steps have a device time to compare the wall time with
    step = backend.engine.step if sim else None

    def counted() -> Any:
        assert step is not None
        out = step()
        simulated.append(out.ms)
        return out

    if sim:
        backend.engine.step = counted
    done: dict[tuple[int, int], float] = {}
    outs: list[Any] = []

    def batch(b: int) -> None:
        hooks = Hooks(done=lambda i, _: done.__setitem__((b, i), time.perf_counter()))
        outs.extend(backend.run([f"throughput {b} row {i}" for i in range(rows)], params, hooks))

    started = time.perf_counter()
    threads = [threading.Thread(target=batch, args=(b,)) for b in range(batches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if sim:
        backend.engine.step = step
    tokens = sum(o.completion_tokens for o in outs if isinstance(o, GenerationOutput))
    free = [at - started for (_, i), at in done.items() if i >= constrained]
    return {"share": share, "tokens_per_s": tokens / elapsed, "tokens": tokens,
            "free_latency_s": sum(free) / len(free) if free else float("nan"),
            "wall_over_device": elapsed / (sum(simulated) / 1000) if simulated else float("nan")}


def hf_runs(rows: int) -> list[dict[str, float]]:
    """:func:`throughput` on hf-causal's continuous engine with the tests' tiny random Llama (CPU)."""
    import tempfile
    from pathlib import Path

    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend
    from harness.models import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        backend = HFCausalBackend("tiny", str(build_tiny_llama(Path(tmp) / "tiny")), "cpu", rows, 256,
                                  continuous=EngineConfig())
        try:
            throughput(backend, rows, 0.0, batches=1)  # warm-up: the first steps and the grammars' compilation
            return [throughput(backend, rows, share) for share in (0.0, 0.5, 1.0)]
        finally:
            backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=int, default=1000, help="constrained outputs to validate")
    parser.add_argument("--rows", type=int, default=100, help="rows at once (the sim's max_batch)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--hf", action="store_true", help="also hf-causal's continuous engine, the tiny model")
    args = parser.parse_args()
    shared = sim_grammars()
    cold, cached = compile_times(lambda: Grammars(shared.tokenizer))
    fast = SimLMBackend(speed=1000.0)  # validity and mask times: the device's time hardly counts
    plain_mask = RowGrammar.mask
    masks = timed_masks()
    generated, valid, cut = validity(fast, args.outputs, args.rows)
    fast.close()
    real = SimLMBackend()  # throughput: the simulated A100's own time
    runs = [throughput(real, args.rows, share) for share in (0.0, 0.5, 1.0)]
    real.close()
    report = {"schemas": len(SCHEMAS), "vocabulary": shared.tokenizer.vocab_size,
              "compile_cold_ms": {"p50": percentile(cold, 50), "p99": percentile(cold, 99), "max": max(cold)},
              "compile_cached_ms": {"p50": percentile(cached, 50), "p99": percentile(cached, 99)},
              "outputs": generated, "valid": valid, "cut_by_max_tokens": cut,
              "mask_us": {"count": len(masks), "p50": percentile(masks, 50), "p99": percentile(masks, 99),
                          "max": max(masks)},
              "throughput": runs}
    if args.hf:
        RowGrammar.mask = plain_mask  # type: ignore[method-assign]
        report["hf_throughput"] = hf_runs(args.rows)
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def markdown(r: dict[str, Any]) -> str:
    base = r["throughput"][0]
    lines = [f"{r['schemas']} schemas, sim-lm vocabulary of {r['vocabulary']} tokens, llguidance",
             "", "| measure | p50 | p99 | max |", "|---|---|---|---|",
             f"| mask per row per token (µs, {r['mask_us']['count']} masks) | {r['mask_us']['p50']:.0f} | "
             f"{r['mask_us']['p99']:.0f} | {r['mask_us']['max']:.0f} |",
             f"| compile, cold (ms) | {r['compile_cold_ms']['p50']:.2f} | {r['compile_cold_ms']['p99']:.2f} | "
             f"{r['compile_cold_ms']['max']:.2f} |",
             f"| compile, cached (ms) | {r['compile_cached_ms']['p50']:.3f} | {r['compile_cached_ms']['p99']:.3f} | |",
             "", f"Valid: {r['valid']} of {r['outputs']} constrained outputs ({r['cut_by_max_tokens']} cut by "
             "max_tokens).", "",
             "| rows constrained | output tokens/s | × unconstrained | free rows' mean latency (s) | "
             "wall time / device time |", "|---|---|---|---|---|"]
    for run in r["throughput"]:
        lines.append(f"| {run['share']:.0%} | {run['tokens_per_s']:.0f} | "
                     f"{run['tokens_per_s'] / base['tokens_per_s']:.2f} | {run['free_latency_s']:.3f} | "
                     f"{run['wall_over_device']:.3f} |")
    if "hf_throughput" in r:
        hf = r["hf_throughput"]
        lines += ["", "hf-causal, continuous engine, tiny random Llama on the CPU:", "",
                  "| rows constrained | output tokens/s | × unconstrained |", "|---|---|---|"]
        lines += [f"| {run['share']:.0%} | {run['tokens_per_s']:.0f} | "
                  f"{run['tokens_per_s'] / hf[0]['tokens_per_s']:.2f} |" for run in hf]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
