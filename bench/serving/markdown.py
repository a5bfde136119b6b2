"""The LLM benchmark's report as Markdown: the generation runs, their cost report, the embedding figures."""
from __future__ import annotations

from typing import Any


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"Machine: {report['machine']}. sim-lm (Llama-2-7B fp16 on one A100 80GB, modelled) at "
             f"LLMB_SIM_LM_SPEED={cfg['speed']:g}; times and rates rescaled to the modelled device (wall x "
             f"{cfg['speed']:g}). {cfg['requests']} streamed /v1/completions calls, Poisson at "
             f"{cfg['rate']:g}/s (modelled time; the same sequence for both modes), max_tokens log-uniform "
             f"{cfg['min_tokens']}..{cfg['max_tokens']}, LLMB_SIM_LM_EOS_MEAN=0 (each answer runs to its "
             f"max_tokens), {cfg['web_workers']} gunicorn processes, one worker at a time (continuous: "
             f"LLMB_SIM_LM_SLOTS=4, the default, batches at once, unless the row says otherwise).", ""]
    lm = report.get("lm", {})
    if lm:
        lines += ["| mode | ok / sent | output tok/s | latency p50 / p99 ms | TTFT p50 / p99 ms "
                  "| p50 ms, max_tokens ≤ 100 / > 500 | batches (mean size) | streams missing deltas |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, s in lm.items():
            lines.append(f"| {mode} | {s['ok']} / {s['requests']} | {s['output_tokens_per_s']} "
                         f"| {s['latency_ms']['p50']} / {s['latency_ms']['p99']} "
                         f"| {s['ttft_ms']['p50']} / {s['ttft_ms']['p99']} "
                         f"| {s['latency_short_ms']['p50']} / {s['latency_long_ms']['p50']} "
                         f"| {s['batches']} ({s['mean_batch_size']}) | {s['streams_missing_deltas']} |")
        price = next(iter(lm.values()))["cost"]["price_per_device_hour"]
        lines += ["", f"Cost report per run (llmb-admin stats' figures over the run; {price:g} per device-hour):", "",
                  "| mode | tokens/s (prompt + output) | output tokens/s | device busy (Σ batch time) "
                  "| device busy (any batch running) | per M tokens | per M output tokens |",
                  "|---|---|---|---|---|---|---|"]
        for mode, s in lm.items():
            c = s["cost"]
            lines.append(f"| {mode} | {c['tokens_per_s']} | {c['output_tokens_per_s']} | {c['device_busy_fraction']} "
                         f"| {c['device_busy_any_batch']} | {c['cost_per_million_tokens']} "
                         f"| {c['cost_per_million_output_tokens']} |")
        for s in lm.values():
            if s.get("static_device_time_measured_over_modelled"):
                lines.append(f"\nStatic batches ran {s['static_device_time_measured_over_modelled']}x the time "
                             "sim-lm's model gives them (1: the simulated device kept its modelled speed here).")
        for mode, s in lm.items():
            a = s.get("llmb_admin_stats", {}).get("rescaled")
            if a:
                lines.append(f"\n`llmb-admin stats --json` during the {mode} arrivals (rescaled): tokens/s "
                             f"{a['tokens_per_s']}, device busy {a['device_busy_fraction']}, per M tokens "
                             f"{a['cost_per_million_tokens']}.")
    emb = report.get("embeddings", {})
    if emb:
        lines += ["", "Embeddings, all-MiniLM-L6-v2 (packaged), sentences of 8-16 words:", "",
                  "| where | batch | sentences/s |", "|---|---|---|"]
        local = emb.get("in_process")
        if local:
            where = f"in process ({local['device']}, {local['torch_threads']} torch threads)"
            for b in (1, 100):
                lines.append(f"| {where} | {b} | {local[f'batch_{b}']['sentences_per_s']} |")
        pipe = emb.get("pipeline")
        if pipe:
            lines.append(f"| pipeline, one caller | 1 per call | {pipe['one_caller_batch_1']['sentences_per_s']} |")
            lines.append(f"| pipeline, one caller | 100 per call | "
                         f"{pipe['one_caller_batch_100']['sentences_per_s']} |")
            c = pipe["callers_100_batch_1"]
            lines.append(f"| pipeline, 100 concurrent callers | 1 per call (batches of {c['mean_batch_size']}) "
                         f"| {c['sentences_per_s']} |")
    return "\n".join(lines)
