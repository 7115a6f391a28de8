"""Assemble the vLLM backend from settings: check the pinned version, export the drafter to
vLLM's EAGLE head format, and build the engine arguments (eager mode on CPU)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from specrl.config import Settings
from specrl.serving.vllm import check_version
from specrl.serving.vllm.loop import VllmLoop
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.serving")


def build_vllm_loop(settings: Settings) -> VllmLoop:
    version = check_version()
    from transformers import AutoTokenizer

    from specrl.assets import resolve_model
    from specrl.export import export_vllm
    from specrl.models.llama import LlamaConfig

    store = WeightsStore(settings.store_path)
    base = resolve_model(settings.model, settings.home)
    policy = store.current("policy")
    model_dir = store.verify("policy", policy) if policy else base
    drafter_dir, drafter_version = _drafter_dir(settings, store, base)
    settings = settings.replace(target_version=policy or settings.target_version, drafter_version=drafter_version)
    eagle_dir = None
    if drafter_dir is not None:
        eagle_dir = Path(tempfile.mkdtemp(prefix="specrl-eagle-"))
        export_vllm(drafter_dir, model_dir, eagle_dir)
    args = engine_args(settings, model_dir, base, eagle_dir)
    options = {"model_dir": str(model_dir), "drafter_dir": str(drafter_dir) if drafter_dir else None,
               "eagle_dir": str(eagle_dir) if eagle_dir else None, "redis_url": settings.redis_url,
               "deployment": settings.deployment, "replica": settings.replica, "content": settings.telemetry_content,
               "maxlen": settings.telemetry_maxlen, "target_version": settings.target_version,
               "drafter_version": drafter_version}
    log.info("vllm backend version=%s model=%s drafter=%s", version, model_dir, drafter_dir)
    return VllmLoop(args, AutoTokenizer.from_pretrained(base), settings, worker_options=options,
                    has_drafter=drafter_dir is not None, vocab_size=LlamaConfig.from_dir(model_dir).vocab_size)


def engine_args(settings: Settings, model_dir: Path, base: Path, eagle_dir: Path | None):
    """-> vLLM's AsyncEngineArgs: eager float32 on CPU, EAGLE speculation when there is an exported
    head (`eagle_dir`), specrl's worker extension."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    speculative = {}
    if eagle_dir is not None:  # vLLM refuses per-request spec-decode metrics without speculation
        speculative = {"speculative_config": {"method": "eagle", "model": str(eagle_dir),
                                              "num_speculative_tokens": settings.max_draft_tokens},
                       "per_request_spec_decode_metrics": "summary"}
    return AsyncEngineArgs(model=str(model_dir), tokenizer=str(base), dtype="float32", enforce_eager=True,
                           max_model_len=settings.max_seq_len, max_num_seqs=settings.max_batch, seed=settings.seed,
                           async_scheduling=False, kv_cache_memory_bytes=settings.vllm_kv_cache_mb << 20,
                           worker_extension_cls="specrl.serving.vllm.worker.SpecrlWorkerExtension",
                           disable_log_stats=False, enable_prefix_caching=False, **speculative)


def _drafter_dir(settings: Settings, store: WeightsStore, base: Path) -> tuple[Path | None, str]:
    """-> (a specrl drafter directory or None, its version): the store's current, else the setting."""
    if settings.drafter == "none":
        return None, "none"
    current = store.current("drafter")
    if current:
        return store.verify("drafter", current), current
    if settings.drafter == "day0":
        from specrl.models.drafter import EagleDrafter
        from specrl.models.llama import load_llama

        out = Path(tempfile.mkdtemp(prefix="specrl-day0-"))
        EagleDrafter.day0(load_llama(base), seed=settings.seed, draft_vocab_size=settings.draft_vocab_size).save(out)
        return out, settings.drafter_version
    return Path(settings.drafter), settings.drafter_version
