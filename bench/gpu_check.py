"""GPU check: one small Hugging Face causal LM through the worker's own backend (HFCausalBackend, in process),
tokens per second at batch 1 and batch 100, static ``generate()`` against continuous batching.

    python -m bench.gpu_check                                 # Qwen/Qwen2.5-0.5B-Instruct, bf16 on CUDA
    python -m bench.gpu_check /models/qwen2.5-0.5b --max-tokens 256 --json gpu.json
    python -m bench.gpu_check --tiny                          # the tests' tiny random Llama (CPU, seconds)

Scenarios, each for both modes: batch 1 (one request at a time, ``--repeat`` of them), batch 100 (one
batch of 100 greedy requests, each asking for ``--max-tokens``) and batch 100 with mixed lengths (``max_tokens``
log-uniform from 8 to ``--max-tokens``: a padded batch runs until its longest row is done, continuous
batching lets short rows leave). tokens/s counts generated tokens only; ``same text`` is how many answers
match the static mode's, token for token (greedy: the two engines use different attention kernels, so bf16
may diverge after a while). The model is loaded once per mode (bf16 on a GPU, fp32 on the CPU), as a worker
would load it; the whole check stops starting new scenarios after ``--budget-s``. A model that cannot be
loaded (unknown id, no network to the hub, out of memory) ends the check with a message and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CANNOT_LOAD = 2


def prompts(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    topics = ["batching", "queues", "GPUs", "tokens", "caches", "latency", "throughput", "schedulers"]
    return [f"Request {i}. Write a few sentences about {rng.choice(topics)} and {rng.choice(topics)}."
            for i in range(n)]


def scenarios(max_tokens: int, seed: int = 5) -> dict[str, list[int]]:
    rng = random.Random(seed)
    mixed = [max(8, min(max_tokens, round(math.exp(rng.uniform(math.log(8), math.log(max_tokens))))))
             for _ in range(100)]
    return {"batch 1": [max_tokens], "batch 100": [max_tokens] * 100, "batch 100, mixed lengths": mixed}


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


def measure(backend: Any, name: str, lengths: list[int], repeat: int) -> dict[str, Any]:
    texts = prompts(len(lengths))
    backend.run(texts[:len(lengths)], [{"max_tokens": 2, "temperature": 0} for _ in lengths])  # warm this shape
    params = [{"max_tokens": n, "temperature": 0} for n in lengths]
    runs = repeat if len(lengths) == 1 else 1
    tokens, wall, outputs = 0, 0.0, []
    for r in range(runs):
        batch = [f"{t} (run {r})" for t in texts] if runs > 1 else texts
        started = time.perf_counter()
        out = backend.run(batch, params)
        wall += time.perf_counter() - started
        tokens += sum(int(o["completion_tokens"]) for o in out)
        outputs += [o["text"] for o in out]
    return {"scenario": name, "requests": len(lengths) * runs, "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "texts": outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"hub id or local folder (default {DEFAULT_MODEL})")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead (runs on the CPU)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per request (default 128; --tiny 32)")
    ap.add_argument("--repeat", type=int, default=3, help="batch-1 requests, one after another")
    ap.add_argument("--modes", nargs="+", choices=["static", "continuous"], default=["static", "continuous"])
    ap.add_argument("--cb-blocks", type=int, help="continuous: KV pages (default 2048 on a GPU, 256 on the CPU)")
    ap.add_argument("--cb-page-size", type=int, default=32)
    ap.add_argument("--cb-max-requests", type=int, help="continuous: most requests per step (default 128; CPU 64)")
    ap.add_argument("--cb-max-batch-tokens", type=int, help="continuous: most tokens per forward pass "
                                                            "(default 2048; CPU 512)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="start no new scenario after this long")
    ap.add_argument("--json", type=Path, help="also write the figures here")
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
        from tests.harness.models import build_tiny_llama

        path = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="llmb-tiny-")) / "tiny-llama"))
    where = torch.cuda.get_device_name(0) if gpu else f"CPU, {torch.get_num_threads()} torch threads"
    print(f"gpu_check: {'tiny random Llama' if args.tiny else path} on {device} ({where}), "
          f"{'bf16' if gpu else 'fp32'}; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"max_tokens {args.max_tokens}; continuous: {args.cb_blocks} pages x {args.cb_page_size} tokens, "
          f"{args.cb_max_requests} requests, {args.cb_max_batch_tokens} tokens per step", flush=True)

    results: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    for mode in args.modes:
        started = time.perf_counter()
        backend = load(path, device, mode == "continuous", args)
        load_s = time.perf_counter() - started
        print(f"  {mode}: loaded and warmed in {load_s:.1f} s", flush=True)
        try:
            for name, lengths in scenarios(args.max_tokens).items():
                if time.monotonic() - began > args.budget_s:
                    skipped.append(f"{mode}: {name}")
                    continue
                r = measure(backend, name, lengths, args.repeat)
                results.setdefault(name, {})[mode] = r
                print(f"  {mode:<10} {name:<26} {r['tokens']:>6} tokens in {r['wall_s']:>7.2f} s: "
                      f"{r['tokens_per_s']:>8.1f} tokens/s", flush=True)
        finally:
            if hasattr(backend, "close"):
                backend.close()
            del backend
            if gpu:
                torch.cuda.empty_cache()

    print("\n| scenario | " + " | ".join(f"{m} tokens/s" for m in args.modes) + " | continuous / static "
          "| same text as static |")
    print("|---|" + "---|" * len(args.modes) + "---|---|")
    for name, by_mode in results.items():
        cells = [str(by_mode[m]["tokens_per_s"]) if m in by_mode else "-" for m in args.modes]
        ratio, same = "-", "-"
        if "static" in by_mode and "continuous" in by_mode:
            s, c = by_mode["static"], by_mode["continuous"]
            ratio = f"{c['tokens_per_s'] / s['tokens_per_s']:.2f}x"
            same = f"{sum(a == b for a, b in zip(s['texts'], c['texts']))}/{len(s['texts'])}"
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio} | {same} |")
    if skipped:
        print(f"\nnot run (past --budget-s {args.budget_s:g}): {', '.join(skipped)}")
    print(f"\ngpu_check: done in {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "model": "tiny" if args.tiny else path, "device": device, "where": where, "max_tokens": args.max_tokens,
            "results": {n: {m: {k: v for k, v in r.items() if k != "texts"} for m, r in by.items()}
                        for n, by in results.items()}, "skipped": skipped}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
