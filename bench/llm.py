"""LLM serving benchmark: sim-lm continuous against static batching through the whole pipeline, and the
throughput of the packaged MiniLM embedding model at batch 1 and 100.

    python -m bench.llm                    # about 4 minutes on 2 cores; Markdown tables on stdout
    python -m bench.llm --quick            # about 1 minute
    python -m bench.llm --json report.json

**Generation.** One system (gunicorn, the batcher, one sim-lm worker at a time, started with
``harness/stack.py``'s ``Stack``, in a namespace of its own) serves the same open-loop Poisson sequence of
``/v1/completions`` calls with ``LLMB_SIM_LM_MODE=continuous``, with ``static``, and (``--slots``, 0 to skip)
continuous with ``LLMB_SIM_LM_SLOTS`` raised from 4 to 32: how many batches a worker runs at once. Every call
streams (``stream=true``), so the client sees its first token (TTFT) and its last chunk (latency, to
``data: [DONE]``) through the API, RabbitMQ, the batcher, the worker and Redis. Output lengths are mixed:
each call's ``max_tokens`` is drawn log-uniformly from ``--min-tokens`` to ``--max-tokens`` (10 to 2,000)
and ``LLMB_SIM_LM_EOS_MEAN=0``, so every answer runs to its own ``max_tokens``. The simulated device runs
``--speed`` times faster than the modelled one (``LLMB_SIM_LM_SPEED``: Llama-2-7B fp16 on one A100 80GB) and
the arrivals are offered ``--speed`` times faster too; every time and rate reported is rescaled to the
modelled device's time (wall time x speed). The pipeline's own overheads (HTTP, broker, batcher wait) are
scaled by the same factor, so they are overstated ``--speed`` times.

The cost report of each run uses ``llmb-admin stats``'s figures (the workers' counters in Redis), taken over
the run: tokens per second (prompt and output tokens, as the workers count them), device-busy fraction
(summed batch run time over wall time: with several batches sharing the continuous engine this counts
overlapping batches more than once, so the share of time with any batch running, from the ledger, is given
beside it) and the cost per million tokens at ``LLMB_DEVICE_PRICE_PER_HOUR`` per device-hour of the
modelled device. ``llmb-admin stats --json``, run during the arrivals, is kept in the JSON report.

How faithfully the machine ran the simulated device is checked on the static run: its batches' measured
run time over what sim-lm's model gives them (1: exact; CPU contention makes it larger).

**Embeddings.** The hf-embed backend (all-MiniLM-L6-v2, packaged) in this process at batch 1 and batch 100
(the best of three trials); then, unless ``--no-pipeline-embed``, an hf-embed worker through the pipeline:
one caller sending one sentence per call, one caller sending 100 per call, and 100 concurrent callers
sending one each (the batcher forms the batches). Sentences per second.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.run import machine
from bench.serving.arrivals import arrivals
from bench.serving.embeddings import embed_in_process, embed_pipeline
from bench.serving.generation import MODES, run_lm, variants
from bench.serving.markdown import markdown
from bench.serving.workers import start_stack


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    calls = arrivals(args.requests, args.rate, args.min_tokens, args.max_tokens, args.seed)
    report: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                              "machine": machine(), "config": {k: v for k, v in vars(args).items() if k != "json"},
                              "lm": {}, "embeddings": {}}
    tmp = Path(tempfile.mkdtemp(prefix="llmb-bench-llm-"))
    need_stack = bool(args.modes) or not (args.no_embed or args.no_pipeline_embed)
    if need_stack:
        stack = start_stack(tmp, args.max_tokens, args.web_workers)
        try:
            for name, mode, device, env in variants(args):
                print(f"  sim-lm {name}: {len(calls)} calls ...", file=sys.stderr, flush=True)
                report["lm"][name] = run_lm(stack, name, mode, device, env, calls, args)
            if not (args.no_embed or args.no_pipeline_embed):
                print("  embeddings through the pipeline ...", file=sys.stderr, flush=True)
                report["embeddings"]["pipeline"] = embed_pipeline(stack, args.embed_seconds)
        finally:
            stack.close()
    if not args.no_embed:
        print("  embeddings in process ...", file=sys.stderr, flush=True)
        report["embeddings"]["in_process"] = embed_in_process(args.embed_seconds)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer calls, a faster device, short embeds")
    ap.add_argument("--requests", type=int, help="calls per mode (default 300; --quick 60)")
    ap.add_argument("--rate", type=float, default=1.5, help="arrivals per second of modelled time")
    ap.add_argument("--speed", type=float, help="LLMB_SIM_LM_SPEED (default 4; --quick 10)")
    ap.add_argument("--min-tokens", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    ap.add_argument("--slots", type=int, default=32,
                    help="also run continuous mode with LLMB_SIM_LM_SLOTS at this (0: skip; the default is 4)")
    ap.add_argument("--timeout-ms", type=int, default=300_000, help="each call's deadline (wall clock)")
    ap.add_argument("--web-workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--embed-seconds", type=float, help="per embedding figure (default 5; --quick 1.5)")
    ap.add_argument("--no-embed", action="store_true", help="skip the embedding figures")
    ap.add_argument("--no-pipeline-embed", action="store_true", help="embeddings in process only")
    ap.add_argument("--json", type=Path, help="also write the whole report (every figure) here")
    args = ap.parse_args(argv)
    if args.requests is None:
        args.requests = 60 if args.quick else 300
    if args.speed is None:
        args.speed = 10.0 if args.quick else 4.0
    if args.embed_seconds is None:
        args.embed_seconds = 1.5 if args.quick else 5.0
    if not 1 <= args.min_tokens <= args.max_tokens:
        ap.error("--min-tokens must be between 1 and --max-tokens")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.monotonic()
    report = build_report(args)
    report["wall_s"] = round(time.monotonic() - started, 1)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
