"""Backends by name, so that heavy ones (torch, transformers) are imported only by the workers that use them."""
from __future__ import annotations

from gpu_worker.backends.interface import Backend
from tasks.config import HfMode, Settings

KINDS = ("sim", "sim-lm", "hf-causal", "hf-embed")


def device_for(gpu: int) -> str:
    """The device a worker pinned with CUDA_VISIBLE_DEVICES uses: its one GPU, or the CPU."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def use_torch_threads(threads: int) -> None:
    """Run torch's CPU operators on ``threads`` threads (``LLMB_TORCH_THREADS``); 0 leaves torch's own choice
    (OMP_NUM_THREADS if set, else a thread per core)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def load_backend(kind: str, settings: Settings, model: str | None = None, gpu: int = 0) -> Backend:
    """Build and warm up a backend; raises ValueError with the list of kinds for an unknown one."""
    if kind == "sim":
        from gpu_worker.backends.sim import SimBackend

        return SimBackend(name=served_name(kind, model, ""), batch_ms=settings.sim.batch_ms,
                          item_ms=settings.sim.item_ms, max_batch=settings.sim.max_batch,
                          raise_on=settings.sim.raise_on, kill_on=settings.sim.kill_on)
    if kind == "sim-lm":
        from gpu_worker.backends.sim_lm import SimLMBackend
        from gpu_worker.backends.sim_lm_adapters import AdapterCosts
        from gpu_worker.backends.sim_lm_engine import Timing

        sim = settings.sim
        costs = AdapterCosts(sim.lm_adapter_step_share, sim.lm_adapter_extra_share, sim.lm_adapter_load_ms,
                             sim.lm_adapter_load_gb_per_s, sim.lm_adapter_rank)

        return SimLMBackend(name=served_name(kind, model, ""), mode=settings.sim.lm_mode, speed=settings.sim.lm_speed,
                            timing=Timing(settings.sim.lm_prefill_ms_per_token, settings.sim.lm_step_ms,
                                          settings.sim.lm_step_ms_per_seq),
                            kv_tokens=settings.sim.lm_kv_tokens, page_size=settings.sim.lm_page_size,
                            prefix_sharing=settings.sim.lm_prefix_sharing, max_seqs=settings.sim.lm_max_seqs,
                            slots=settings.sim.lm_slots, max_batch=settings.batcher.max_batch_size,
                            max_context=settings.sim.lm_max_context, eos_mean=settings.sim.lm_eos_mean,
                            max_adapters=settings.models.max_adapters,
                            adapters_per_step=settings.models.max_adapters_per_batch, adapter_costs=costs)
    if kind == "hf-embed":
        from gpu_worker.backends.hf_embed import HFEmbedBackend, default_model_path

        path = model or default_model_path()
        use_torch_threads(settings.worker.torch_threads)
        return HFEmbedBackend(name=served_name(kind, model, settings.models.served_name), path=path,
                              device=device_for(gpu), max_batch=settings.batcher.max_batch_size)
    if kind == "hf-causal":
        if not model:
            raise ValueError("--backend hf-causal needs --model (a hub id such as Qwen/Qwen2.5-0.5B-Instruct, "
                             "or a local folder)")
        from gpu_worker.backends.continuous import EngineConfig
        from gpu_worker.backends.hf_causal import HFCausalBackend

        m = settings.models  # its mode an HfMode: a misspelt one stopped the process when its settings were read
        engine = EngineConfig(m.cb_num_blocks, m.cb_page_size, m.cb_max_batch_tokens,
                              m.cb_max_requests) if m.hf_mode is HfMode.CONTINUOUS else None
        use_torch_threads(settings.worker.torch_threads)
        return HFCausalBackend(name=served_name(kind, model, settings.models.served_name), path=model,
                               device=device_for(gpu), max_batch=settings.batcher.max_batch_size,
                               max_tokens_cap=settings.models.max_tokens_cap, continuous=engine,
                               slots=settings.models.cb_slots, max_adapters=m.max_adapters,
                               adapters_per_step=m.max_adapters_per_batch)
    raise ValueError(f"unknown backend {kind!r}; available: {', '.join(KINDS)}")


def served_name(kind: str, model: str | None, configured: str) -> str:
    """The model name a worker of backend ``kind`` serves (what callers put in "model", and what the autoscaling
    series are labelled with): the sim backends' --model, else their kind; for hf-* LLMB_SERVED_NAME
    (``configured``), else the model's own name. Pure, so that deploy manifests can be checked against it."""
    if kind in ("sim", "sim-lm"):
        return model or kind
    if kind == "hf-embed":
        return configured or _name_of(model, "all-MiniLM-L6-v2")
    if kind == "hf-causal":
        return configured or _name_of(model, model or "")
    raise ValueError(f"unknown backend {kind!r}; available: {', '.join(KINDS)}")


def _name_of(model: str | None, default: str) -> str:
    """A hub id names itself; a local folder is named after its last part."""
    if not model:
        return default
    return model.rstrip("/").split("/")[-1] if model.startswith(("/", ".")) else model
