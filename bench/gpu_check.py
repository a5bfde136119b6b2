"""GPU check: one small Hugging Face causal LM through the worker's own backend (HFCausalBackend, in process),
tokens per second and time to first token at batch 1 and batch 100, static ``generate()`` against continuous
batching, greedy and sampled, and the continuous engine's prompt-block hits.

    python -m bench.gpu_check                                 # Qwen/Qwen2.5-0.5B-Instruct, bf16 on CUDA
    python -m bench.gpu_check /models/qwen2.5-0.5b --max-tokens 256 --json gpu.json
    python -m bench.gpu_check --tiny                          # the tests' tiny random Llama (CPU, seconds)
    python -m bench.gpu_check --lora-only                     # only the LoRA adapters' scenarios

Scenarios, each for both modes: batch 1 (one request at a time, ``--repeat`` of them), batch 100 (one
batch of 100 greedy requests, each asking for ``--max-tokens``), batch 100 with mixed lengths (``max_tokens``
log-uniform from 8 to ``--max-tokens``: a padded batch runs until its longest row is done, continuous
batching lets short rows leave), the same sampled (temperature 0.8, top_p 0.95, a distinct seed each: static
runs one ``generate()`` per seed, continuous runs them together through the seeded sampler), and batch 100
sharing a long system prompt, sent twice (the second time the continuous engine finds its blocks cached:
``prefix hits`` is the share of prompt blocks looked up that were). tokens/s counts generated tokens only;
TTFT is the median time to each request's first streamed token; ``same text`` is how many answers match the
static mode's, token for token (greedy: the two engines use different attention kernels, so bf16 may diverge
after a while); for the sampled scenario it is instead how many of 8 seeded requests give the same text run
alone as in the batch of 100 (on the continuous engine; a bf16 near-tie may flip with the batch's shape).
Continuous runs first, so that the budget cuts static's scenarios (sampled static is one ``generate()`` per
seed, slow) rather than the engine the worker uses by default. The model is loaded once per
mode (bf16 on a GPU, fp32 on the CPU), as a worker would load it; the whole check stops starting new scenarios
after ``--budget-s``. A model that cannot be loaded (unknown id, no network to the hub, out of memory) ends the
check with a message and exit status 2.

LoRA adapters (issue 44; ``--no-lora`` skips them): after those scenarios, while the budget lasts, the continuous
engine runs one batch of ``--lora-rows`` greedy rows of ``--lora-max-tokens`` tokens with 1, 4 and 16 distinct
adapters (16 random rank-``--lora-rank`` PEFT adapters on the attention projections, made here with PEFT) against
the base model alone on a worker without adapter slots, and 16 adapters under the default per-step cap of 4: the
scenarios of ``python -m bench.lora_engine`` (:func:`bench.lora_engine.run_all`), end-of-sequence tokens biased
away so that every row generates all its tokens. They need ``peft`` (the ``models`` extra).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.stats import percentile, rounded
from tasks.schema import GenerationOutput, SamplingParams

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CANNOT_LOAD = 2


def prompts(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    topics = ["batching", "queues", "GPUs", "tokens", "caches", "latency", "throughput", "schedulers"]
    return [f"Request {i}. Write a few sentences about {rng.choice(topics)} and {rng.choice(topics)}."
            for i in range(n)]


SYSTEM = ("You are the assistant of a team that runs a batching service for language models. Answer in plain "
          "words, briefly, and say when you do not know. ")


SEEDED_ALONE = 8  # sampled requests run again alone, to compare with their text in the batch
TINY_SYSTEM = "the cat sat on a mat; the queue is fast; " * 4  # the tiny model's words and context (256 tokens)


def scenarios(max_tokens: int, shared: str, seed: int = 5) -> dict[str, tuple[list[int], bool, str]]:
    """Per scenario: each request's max_tokens, whether sampled, and the prompt start they share ('' none)."""
    rng = random.Random(seed)
    mixed = [max(8, min(max_tokens, round(math.exp(rng.uniform(math.log(8), math.log(max_tokens))))))
             for _ in range(100)]
    return {"batch 1": ([max_tokens], False, ""), "batch 100": ([max_tokens] * 100, False, ""),
            "batch 100, mixed lengths": (mixed, False, ""),
            "batch 100, mixed lengths, sampled": (mixed, True, ""),
            "batch 100, shared prompt (2nd time)": ([16] * 100, False, shared)}


def load(path: str, device: str, continuous: bool, args: argparse.Namespace) -> Any:
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    engine = EngineConfig(args.cb_blocks, args.cb_page_size, args.cb_max_batch_tokens,
                          args.cb_max_requests) if continuous else None
    try:
        return HFCausalBackend("check", path, device, 100, max(args.max_tokens, 16), continuous=engine, slots=1)
    except Exception as exc:  # unknown id, no network, no memory, a model transformers cannot build
        print(f"gpu_check: cannot load the model {path!r} on {device} "
              f"({'continuous' if continuous else 'static'} mode): {type(exc).__name__}: {exc}\n"
              "Pass a hub id this host can download, a local folder holding the model, or --tiny.",
              file=sys.stderr)
        sys.exit(CANNOT_LOAD)


def measure(backend: Any, name: str, lengths: list[int], repeat: int, sampled: bool = False,
            shared: str = "") -> dict[str, Any]:
    from gpu_worker.backends.interface import Hooks

    texts = [shared + t for t in prompts(len(lengths))]
    params = [SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=100 + i) if sampled else
              SamplingParams(max_tokens=n, temperature=0) for i, n in enumerate(lengths)]
    if shared:  # the first time fills the cache; the second is measured
        backend.run(texts, params)
    else:
        backend.run(texts, [replace(p, max_tokens=2) for p in params])  # warm this shape
    runs = repeat if len(lengths) == 1 else 1
    tokens, wall, outputs, firsts = 0, 0.0, [], []
    cache = backend.prefix_cache()
    for r in range(runs):
        batch = [f"{t} (run {r})" for t in texts] if runs > 1 else texts
        first: dict[int, float] = {}

        def stream(deltas: list[tuple[int, str]], first: dict[int, float] = first) -> None:
            now = time.perf_counter()
            for index, _ in deltas:
                first.setdefault(index, now)

        started = time.perf_counter()
        out = backend.run(batch, params, Hooks(streaming=set(range(len(batch))), stream=stream))
        wall += time.perf_counter() - started
        firsts += [(t - started) * 1000 for t in first.values()]
        failed = [o for o in out if not isinstance(o, GenerationOutput)]
        if failed:
            raise SystemExit(f"gpu_check: {name}: {len(failed)} requests failed, e.g. {failed[0]}")
        tokens += sum(o.completion_tokens for o in out)
        outputs += [o.text for o in out]
    alone_same = "-"
    if sampled:  # a seed's text alone against the same request's in the batch (batch shapes and kernels differ)
        alone = [backend.run([texts[i]], [params[i]])[0].text for i in range(SEEDED_ALONE)]
        alone_same = f"{sum(a == b for a, b in zip(alone, outputs))}/{SEEDED_ALONE}"
    after = backend.prefix_cache()
    looked = after.queries - cache.queries
    return {"scenario": name, "requests": len(lengths) * runs, "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": rounded(percentile(firsts, 50)),
            "prefix_hits": f"{(after.hits - cache.hits) / looked:.0%}" if looked else "-",
            "sampled": sampled, "seeded_alone_same": alone_same, "texts": outputs}


def print_table(results: dict[str, dict[str, Any]], modes: list[str]) -> None:
    print("\n| scenario | " + " | ".join(f"{m} tokens/s | {m} TTFT p50 ms" for m in modes) +
          " | continuous / static | prefix hits (continuous) | same text as static |")
    print("|---|" + "---|---|" * len(modes) + "---|---|---|")
    for name, by_mode in results.items():
        cells = [f"{by_mode[m]['tokens_per_s']} | {by_mode[m]['ttft_p50_ms']}" if m in by_mode else "- | -"
                 for m in modes]
        ratio, same = "-", "-"
        hits = by_mode["continuous"]["prefix_hits"] if "continuous" in by_mode else "-"
        if "static" in by_mode and "continuous" in by_mode:
            s, c = by_mode["static"], by_mode["continuous"]
            ratio = f"{c['tokens_per_s'] / s['tokens_per_s']:.2f}x"
            if not s["sampled"]:
                same = f"{sum(a == b for a, b in zip(s['texts'], c['texts']))}/{len(s['texts'])}"
        if "continuous" in by_mode and by_mode["continuous"]["sampled"]:
            same = f"seeded, alone = batched: {by_mode['continuous']['seeded_alone_same']}"
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio} | {hits} | {same} |")


def run_modes(path: str, device: str, gpu: bool, args: argparse.Namespace,
              began: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The static / continuous scenarios, each mode's model loaded once; those past the budget are skipped."""
    import torch

    results: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    for mode in [] if args.lora_only else args.modes:
        started = time.perf_counter()
        backend = load(path, device, mode == "continuous", args)
        load_s = time.perf_counter() - started
        print(f"  {mode}: loaded and warmed in {load_s:.1f} s", flush=True)
        try:
            shared_start = TINY_SYSTEM if args.tiny else SYSTEM * 6
            for name, (lengths, sampled, shared) in scenarios(args.max_tokens, shared_start).items():
                if time.monotonic() - began > args.budget_s:
                    skipped.append(f"{mode}: {name}")
                    continue
                r = measure(backend, name, lengths, args.repeat, sampled, shared)
                results.setdefault(name, {})[mode] = r
                print(f"  {mode:<10} {name:<36} {r['tokens']:>6} tokens in {r['wall_s']:>7.2f} s: "
                      f"{r['tokens_per_s']:>8.1f} tokens/s, TTFT p50 {r['ttft_p50_ms']} ms, "
                      f"prefix hits {r['prefix_hits']}", flush=True)
        finally:
            if hasattr(backend, "close"):
                backend.close()
            del backend
            if gpu:
                torch.cuda.empty_cache()
    return results, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"hub id or local folder (default {DEFAULT_MODEL})")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead (runs on the CPU)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per request (default 128; --tiny 32)")
    ap.add_argument("--repeat", type=int, default=3, help="batch-1 requests, one after another")
    ap.add_argument("--modes", nargs="+", choices=["static", "continuous"], default=["continuous", "static"])
    ap.add_argument("--cb-blocks", type=int, help="continuous: KV pages (default 2048 on a GPU, 256 on the CPU)")
    ap.add_argument("--cb-page-size", type=int, default=32)
    ap.add_argument("--cb-max-requests", type=int, help="continuous: most requests per step (default 128; CPU 64)")
    ap.add_argument("--cb-max-batch-tokens", type=int, help="continuous: most tokens per forward pass "
                                                            "(default 2048; CPU 512)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="start no new scenario after this long")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA adapters' scenarios")
    ap.add_argument("--lora-only", action="store_true", help="only the LoRA adapters' scenarios")
    ap.add_argument("--lora-rows", type=int, default=64, help="LoRA: rows per batch")
    ap.add_argument("--lora-max-tokens", type=int, default=64, help="LoRA: new tokens per row")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-repeat", type=int, default=3, help="LoRA: rounds of every scenario (medians)")
    args = ap.parse_args(argv)
    began = time.monotonic()

    import torch
    import transformers

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})", file=sys.stderr)
        return CANNOT_LOAD
    gpu = device.startswith("cuda")
    args.max_tokens = args.max_tokens or (32 if args.tiny else 128)
    args.cb_blocks = args.cb_blocks or (2048 if gpu else 256)
    args.cb_max_requests = args.cb_max_requests or (128 if gpu else 64)
    args.cb_max_batch_tokens = args.cb_max_batch_tokens or (2048 if gpu else 512)
    path = args.model
    if args.tiny:
        from harness.models import build_tiny_llama

        path = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="llmb-tiny-")) / "tiny-llama"))
    where = torch.cuda.get_device_name(0) if gpu else f"CPU, {torch.get_num_threads()} torch threads"
    print(f"gpu_check: {'tiny random Llama' if args.tiny else path} on {device} ({where}), "
          f"{'bf16' if gpu else 'fp32'}; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"max_tokens {args.max_tokens}; continuous: {args.cb_blocks} pages x {args.cb_page_size} tokens, "
          f"{args.cb_max_requests} requests, {args.cb_max_batch_tokens} tokens per step", flush=True)

    results, skipped = run_modes(path, device, gpu, args, began)
    if results:
        print_table(results, args.modes)
    lora: list[dict[str, Any]] = []
    if not args.no_lora:
        lora = lora_scenarios(path, device, args, began)
        if not lora:
            skipped.append("LoRA adapters")
    if skipped:
        print(f"\nnot run (past --budget-s {args.budget_s:g}): {', '.join(skipped)}")
    print(f"\ngpu_check: done in {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "model": "tiny" if args.tiny else path, "device": device, "where": where, "max_tokens": args.max_tokens,
            "results": {n: {m: {k: v for k, v in r.items() if k != "texts"} for m, r in by.items()}
                        for n, by in results.items()}, "lora": lora, "skipped": skipped}, indent=2))
    return 0


def lora_scenarios(path: str, device: str, args: argparse.Namespace, began: float) -> list[dict[str, Any]]:
    """The LoRA scenarios of bench.lora_engine on the continuous engine, on this model and device (see above)."""
    from bench.lora_engine import DEFAULT_TARGETS, make_adapters, run_all, table
    from gpu_worker.backends.continuous import EngineConfig
    from gpu_worker.backends.hf_causal import HFCausalBackend

    if time.monotonic() - began > args.budget_s:
        return []
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="llmb-lora-"))
    adapters = make_adapters(path, folder, 16, args.lora_rank, DEFAULT_TARGETS)
    print(f"  LoRA: 16 adapters of rank {args.lora_rank} on {', '.join(DEFAULT_TARGETS)} made in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    never_end: list[int] = []

    def backend_for(cap: int) -> Any:
        engine = EngineConfig(args.cb_blocks, args.cb_page_size, args.cb_max_batch_tokens, args.cb_max_requests)
        backend = HFCausalBackend("check", path, device, max(args.lora_rows, 16), args.lora_max_tokens,
                                  continuous=engine, slots=1, max_adapters=16 if cap else 0,
                                  adapters_per_step=max(1, cap))
        never_end[:] = backend.eos_ids
        return backend

    settings = argparse.Namespace(rows=args.lora_rows, max_tokens=args.lora_max_tokens, repeat=args.lora_repeat)
    results = run_all(backend_for, adapters, settings, "continuous", never_end,
                      budget=began + args.budget_s + 120)  # the rounds started get to finish past the budget
    print("\nLoRA adapters (continuous engine):\n" + table(results))
    return results


if __name__ == "__main__":
    sys.exit(main())
