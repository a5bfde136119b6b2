"""The measurement that chose the grammar engine: llguidance against xgrammar, one schema set, one tokenizer.

    python -m bench.grammar_engines              # a Markdown table on stdout, about a minute on 2 cores
    python -m bench.grammar_engines --json F

xgrammar is not a dependency (it pulls torch, transformers and triton); to include it, install it beside the
project without its dependencies, which the environment already has: ``pip install --no-deps -t /tmp/xgr
xgrammar apache-tvm-ffi`` and run with ``PYTHONPATH=/tmp/xgr``. Without it only llguidance is measured.

The tokenizer is a byte-level BPE of ``--vocab`` tokens (32,000 by default, a Llama-sized vocabulary) trained here,
offline, on the Python standard library's sources. For each of bench/constrained.py's 24 schemas the grammar is
compiled cold, then ``--walks`` seeded random walks run to the grammar's end (or ``--max-tokens``): at each token
the engine computes the row's mask into a bitmask (timed: the per-row, per-token cost inside a step), the walk
takes a random allowed token, and the engine consumes it. Both engines see the same walks' prefixes only in
distribution, not token for token (each draws from its own mask).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import random
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.constrained import SCHEMAS
from harness.stats import percentile


def tokenizer(vocab: int) -> Any:
    """A fast (transformers) tokenizer: byte-level BPE trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts() -> Iterator[str]:
        for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:400]:
            yield Path(path).read_text(errors="replace")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


class Engine(Protocol):
    """What a walk needs of an engine: compile a schema, then per token fill a mask and consume a token."""

    name: str

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def start(self, compiled: Any) -> Any: ...
    def fill(self, row: Any) -> None: ...  # the row's mask, computed into its bitmask (what is timed)
    def allowed(self, row: Any) -> np.ndarray: ...  # the token ids its bitmask allows
    def consume(self, row: Any, token: int) -> None: ...
    def done(self, row: Any) -> bool: ...


class Llguidance:
    name = "llguidance"

    def __init__(self, hf: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(hf)
        self.words = self.tok.vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                              overrides={"whitespace_flexible": False})
        return self.llg.LLMatcher(self.tok, grammar)

    def start(self, compiled: Any) -> Any:
        row = compiled.deep_copy()
        return row, self.np.allocate_token_bitmask(1, self.words)

    def fill(self, row: Any) -> None:
        self.np.fill_next_token_bitmask(row[0], row[1], 0)

    def allowed(self, row: Any) -> np.ndarray:
        return _allowed(row[1][0], self.words)

    def consume(self, row: Any, token: int) -> None:
        row[0].consume_token(token)

    def done(self, row: Any) -> bool:
        return bool(row[0].is_stopped() or row[0].is_error())


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.words = len(hf)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def start(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.words)

    def fill(self, row: Any) -> None:
        row[0].fill_next_token_bitmask(row[1], 0)

    def allowed(self, row: Any) -> np.ndarray:
        return _allowed(row[1][0].numpy(), self.words)

    def consume(self, row: Any, token: int) -> None:
        row[0].accept_token(token)

    def done(self, row: Any) -> bool:
        return bool(row[0].is_terminated())


def _allowed(bits: np.ndarray, words: int) -> np.ndarray:
    flags = np.unpackbits(bits.astype(np.int32).view(np.uint8), bitorder="little")[:words]
    return np.flatnonzero(flags)


def measure(engine: Engine, walks: int, max_tokens: int, eos: int) -> dict[str, Any]:
    compile_ms: list[float] = []
    masks_us: list[float] = []
    finished = 0
    for i, schema in enumerate(SCHEMAS):
        started = time.perf_counter()
        compiled = engine.compile(schema)
        compile_ms.append((time.perf_counter() - started) * 1000)
        for w in range(walks):
            rng, row = random.Random(i * 1000 + w), engine.start(compiled)
            for _ in range(max_tokens):
                started = time.perf_counter()
                engine.fill(row)
                masks_us.append((time.perf_counter() - started) * 1e6)
                allowed = engine.allowed(row)
                if len(allowed) == 0:
                    break
                # lean toward ending, as a model does: the end of sequence when allowed, else any allowed token
                token = eos if eos in allowed and rng.random() < 0.5 else int(allowed[rng.randrange(len(allowed))])
                engine.consume(row, token)
                if engine.done(row):
                    finished += 1
                    break
    return {"engine": engine.name, "schemas": len(SCHEMAS), "walks": walks * len(SCHEMAS), "finished": finished,
            "masks": len(masks_us), **_stats("compile_ms", compile_ms), **_stats("mask_us", masks_us)}


def _stats(name: str, values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p50, p99 = percentile(ordered, 50) or 0.0, percentile(ordered, 99) or 0.0
    return {f"{name}_p50": round(p50, 3), f"{name}_p99": round(p99, 3),
            f"{name}_max": round(ordered[-1], 3), f"{name}_mean": round(sum(ordered) / len(ordered), 3)}


def engines(hf: Any) -> list[Engine]:
    found: list[Engine] = [Llguidance(hf)]
    makers: list[Callable[[Any], Engine]] = [Xgrammar]
    for make in makers:
        with contextlib.suppress(ImportError):  # xgrammar is optional: see the module's docstring
            found.append(make(hf))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--walks", type=int, default=5, help="random walks per schema")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    hf = tokenizer(args.vocab)
    eos = hf.convert_tokens_to_ids("<eos>")
    results = [measure(e, args.walks, args.max_tokens, eos) for e in engines(hf)]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"vocabulary {len(hf)} tokens; {len(SCHEMAS)} schemas x {args.walks} walks\n")
    print("| engine | compile p50 / p99 ms | mask mean / p50 / p99 / max µs | masks | walks ended |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['compile_ms_p50']} / {r['compile_ms_p99']} | {r['mask_us_mean']} / "
              f"{r['mask_us_p50']} / {r['mask_us_p99']} / {r['mask_us_max']} | {r['masks']} | "
              f"{r['finished']} of {r['walks']} |")


if __name__ == "__main__":
    main()
