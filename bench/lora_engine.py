"""LoRA adapters on hf-causal's engine: tokens/s with 1, 4 and 16 distinct adapters per batch against the base model
alone, same batch size and lengths (issue 44).

    python -m bench.lora_engine                      # the tests' tiny random Llama on the CPU, about a minute
    python -m bench.lora_engine --rows 64 --max-tokens 32 --repeat 5 --modes continuous static --json lora.json

The model is the tests' tiny random Llama (2 layers, hidden 64), built here with generation's end-of-sequence
token turned off so that every row generates exactly ``--max-tokens`` (random weights would otherwise stop rows at
different points, and each adapter at its own). 16 random PEFT LoRA adapters (rank ``--rank`` on ``--targets``)
are made with PEFT and loaded by a first run of each scenario (its time is reported apart), so the figures are
those of resident adapters: the base layers once for the batch, each adapter's delta gathered for its tokens.

Each scenario is one batch of ``--rows`` greedy rows with distinct prompts, the adapters dealt out round-robin, on
the continuous engine (``--modes static`` adds padded ``generate()``). The base model is measured twice: on a
worker without adapter slots (no hooks: the reference, "vs base") and as base rows on a worker with them (the
hooks' cost when no adapter runs). The per-step cap (``LLMB_MAX_ADAPTERS_PER_BATCH``) is the scenario's count,
so that 16 adapters share the same steps; the last scenario runs 16 adapters under the default cap of 4. The
scenarios run in ``--repeat`` rounds, each in turn, medians reported: wall time and this process's CPU time (the
engine's thread included), the second steadier on a shared host. ``bench/gpu_check.py`` runs the same
measurement on a GPU (:func:`run_all`).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks.schema import GenerationOutput, SamplingParams

COUNTS = (0, 1, 4, 16)  # distinct adapters per batch (0: base rows on a worker that has adapter slots)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def prompts(n: int) -> list[str]:
    words = ["the", "cat", "sat", "on", "a", "mat", "batch", "model", "token", "queue", "fast", "worker"]
    return [" ".join(words[(i * 7 + k * 3) % len(words)] for k in range(6 + i % 5)) + f" {i}" for i in range(n)]


def make_adapters(model_path: str, folder: Path, count: int, rank: int, targets: tuple[str, ...]) -> list[Path]:
    """``count`` random LoRA adapters of the model (B not zero, so each changes the output), saved by PEFT."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    out = []
    for i in range(count):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                          init_lora_weights=False))
        model.save_pretrained(str(folder / f"adapter-{i}"))
        base = model.unload()  # the base model without the LoRA layers, for the next adapter
        out.append(folder / f"adapter-{i}")
    return out


def batch(adapters: list[Path], distinct: int, rows: int, max_tokens: int,
          never_end: list[int] | None = None) -> tuple[list[str], list[SamplingParams]]:
    """``rows`` greedy rows, ``distinct`` adapters dealt out round-robin (0: base rows). ``never_end``: token ids
    biased away (-100) so that a real model generates every row to ``max_tokens`` too."""
    bias = tuple((t, -100.0) for t in never_end or ())

    def p(i: int) -> SamplingParams:
        extra: dict[str, Any] = {}
        if distinct:
            extra = {"adapter": f"adapter-{i % distinct}", "adapter_path": str(adapters[i % distinct])}
        return SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=bias, **extra)

    return prompts(rows), [p(i) for i in range(rows)]


def run_once(backend: Any, texts: list[str], params: list[SamplingParams]) -> tuple[int, float, float]:
    """Tokens generated, wall seconds and this process's CPU seconds (every thread: the engine's too)."""
    started, cpu = time.perf_counter(), time.process_time()
    out = backend.run(texts, params)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    failed = [o for o in out if not isinstance(o, GenerationOutput)]
    if failed:
        raise SystemExit(f"lora_engine: {len(failed)} rows failed, e.g. {failed[0]}")
    return sum(o.completion_tokens for o in out if isinstance(o, GenerationOutput)), wall, cpu


SCENARIOS = [(0, 0)] + [(n, max(1, n)) for n in COUNTS] + [(16, 4)]  # (distinct, cap); cap 0: no adapter slots


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| mode | distinct adapters per batch | per-step cap | rows | tokens | wall s (median) | tokens/s | "
             "vs base | tokens per CPU-s | vs base |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = next((b for b in results if b["mode"] == r["mode"] and b["cap"] == 0), None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        cpu_ratio = f"{r['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x" if base else "-"
        what = r["adapters"] or ("none: worker without adapter slots" if r["cap"] == 0 else
                                 "none: base rows, adapter hooks on")
        lines.append(f"| {r['mode']} | {what} | {r['cap'] if r['adapters'] else '-'} | {r['rows']} | {r['tokens']} "
                     f"| {r['wall_s']} | {r['tokens_per_s']} | {ratio} | {r['tokens_per_cpu_s']} | {cpu_ratio} |")
    return "\n".join(lines)


def run_all(backend_for: Any, adapters: list[Path], args: argparse.Namespace, mode: str,
            never_end: list[int] | None = None, budget: float = float("inf")) -> list[dict[str, Any]]:
    """Every scenario on one mode, a backend per per-step cap (``backend_for(cap)``; cap 0: no adapter slots). A
    first run of each loads its adapters (reported apart); then ``args.repeat`` rounds, each running every scenario
    once in turn (so that a shared host's load drifts over all of them alike); medians reported."""
    scenarios = [(d, c) for d, c in SCENARIOS if d <= len(adapters)]
    backends: dict[int, Any] = {}
    runs: dict[tuple[int, int], list[tuple[int, float, float]]] = {sc: [] for sc in scenarios}
    first: dict[tuple[int, int], float] = {}
    try:
        for distinct, cap in scenarios:
            if cap not in backends:
                backends[cap] = backend_for(cap)
            started = time.perf_counter()
            run_once(backends[cap], *batch(adapters, distinct, args.rows, 2, never_end))  # loads its adapters
            first[(distinct, cap)] = time.perf_counter() - started
        for _ in range(args.repeat):
            if time.monotonic() > budget:
                break
            for distinct, cap in scenarios:
                runs[(distinct, cap)].append(
                    run_once(backends[cap], *batch(adapters, distinct, args.rows, args.max_tokens, never_end)))
    finally:
        for backend in backends.values():
            backend.close()
    results = []
    for (distinct, cap), done in runs.items():
        if not done:
            continue
        tokens = done[-1][0]
        wall, cpu = statistics.median(w for _, w, _ in done), statistics.median(c for _, _, c in done)
        r = {"mode": mode, "adapters": distinct, "cap": cap, "rows": args.rows, "tokens": tokens,
             "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
             "tokens_per_cpu_s": round(tokens / cpu, 1), "first_run_s": round(first[(distinct, cap)], 3),
             "walls": [round(w, 3) for _, w, _ in done]}
        print(f"  {mode:<10} {distinct:>2} adapters, cap {cap:>2}: {tokens} tokens, median {r['wall_s']} s, "
              f"{r['tokens_per_s']} tokens/s, {r['tokens_per_cpu_s']} per CPU-s (first run, loading: "
              f"{r['first_run_s']} s)", flush=True)
        results.append(r)
    return results


def tiny_model(folder: Path) -> str:
    """The tests' tiny Llama, its end-of-sequence turned off (every row runs to max_tokens)."""
    from harness.models import build_tiny_llama

    path = build_tiny_llama(folder)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config_file.write_text(json.dumps({**config, "eos_token_id": -1}))
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="rows per batch")
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per row (each generates exactly this)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of every batch (medians reported)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    ap.add_argument("--modes", nargs="+", choices=["continuous", "static"], default=["continuous"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a 2-core host's figures steadier)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()  # the warning that eos_token_id -1 never ends a row
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    root = Path(tempfile.mkdtemp(prefix="llmb-lora-bench-"))
    path = tiny_model(root / "tiny-llama")
    adapters = make_adapters(path, root, max(COUNTS), args.rank, tuple(args.targets))
    print(f"lora_engine: tiny random Llama, CPU ({args.threads} torch threads), {args.rows} rows x {args.max_tokens} "
          f"tokens, {len(adapters)} adapters of rank {args.rank} on {', '.join(args.targets)}", flush=True)
    results = []
    for mode in args.modes:
        def backend_for(cap: int, mode: str = mode) -> Any:
            return HFCausalBackend("tiny", path, "cpu", max(args.rows, 16), args.max_tokens,
                                   continuous=EngineConfig() if mode == "continuous" else None, slots=1,
                                   max_adapters=max(COUNTS) if cap else 0, adapters_per_step=max(1, cap))

        results += run_all(backend_for, adapters, args, mode)
    print()
    print(table(results))
    print(f"\n`python -m bench.lora_engine {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip() +
          f", {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC")
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "max_tokens": args.max_tokens, "rank": args.rank,
                                         "targets": args.targets, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
