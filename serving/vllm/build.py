"""Assemble the vLLM backend from settings: check the pinned version, export the drafter to
vLLM's EAGLE head format, and build the engine arguments (eager mode on CPU)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from specrl.config import Settings
from specrl.models.calibration import cpu_info, resolve_dtype
from specrl.engine.start import DAY0, StartWeights, build_drafter, start_weights
from specrl.serving.vllm import check_version
from specrl.serving.vllm.loop import VllmLoop
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.serving")


def build_vllm_loop(settings: Settings, store: WeightsStore) -> VllmLoop:
    version = check_version()
    from transformers import AutoTokenizer

    from specrl.assets import resolve_model
    from specrl.export import export_vllm
    from specrl.models.llama import LlamaConfig

    base = resolve_model(settings.model, settings.home)
    start = start_weights(settings, base, store)
    model_dir, drafter_dir, drafter_version = start.policy_dir, _drafter_dir(start, settings, base), start.drafter_version
    settings = settings.replace(target_version=start.policy_version, drafter_version=drafter_version)
    eagle_dir = None
    if drafter_dir is not None:
        eagle_dir = Path(tempfile.mkdtemp(prefix="specrl-eagle-"))
        export_vllm(drafter_dir, model_dir, eagle_dir)
    dtype, dtype_reason = resolve_dtype(settings.dtype, cpu_info()[1])
    args = engine_args(settings, model_dir, base, eagle_dir, str(dtype).removeprefix("torch."))
    options = {"model_dir": str(model_dir), "drafter_dir": str(drafter_dir) if drafter_dir else None,
               "eagle_dir": str(eagle_dir) if eagle_dir else None, "redis_url": settings.redis_url,
               "deployment": settings.deployment, "replica": settings.replica, "content": settings.telemetry_content,
               "maxlen": settings.telemetry_maxlen, "target_version": settings.target_version,
               "drafter_version": drafter_version}
    log.info("vllm backend version=%s model=%s drafter=%s %s", version, model_dir, drafter_dir, dtype_reason)
    return VllmLoop(args, AutoTokenizer.from_pretrained(base), settings, worker_options=options,
                    has_drafter=drafter_dir is not None, vocab_size=LlamaConfig.from_dir(model_dir).vocab_size,
                    info={"backend": "vllm", "dtype": args.dtype, "dtype_reason": dtype_reason})


def engine_args(settings: Settings, model_dir: Path, base: Path, eagle_dir: Path | None, dtype: str = "float32"):
    """-> vLLM's AsyncEngineArgs: eager mode on CPU in `dtype` (settings.dtype resolved by the CPU's
    flags, as the native engine does: vLLM-CPU would pick bf16 for an fp32 checkpoint on any x86),
    EAGLE speculation when there is an exported head (`eagle_dir`), specrl's worker extension."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    speculative = {}
    if eagle_dir is not None:  # vLLM refuses per-request spec-decode metrics without speculation
        speculative = {"speculative_config": {"method": "eagle", "model": str(eagle_dir),
                                              "num_speculative_tokens": settings.max_draft_tokens},
                       "per_request_spec_decode_metrics": "summary"}
    return AsyncEngineArgs(model=str(model_dir), tokenizer=str(base), dtype=dtype, enforce_eager=True,
                           max_model_len=settings.max_seq_len, max_num_seqs=settings.max_batch, seed=settings.seed,
                           async_scheduling=False, kv_cache_memory_bytes=settings.vllm_kv_cache_mb << 20,
                           worker_extension_cls="specrl.serving.vllm.worker.SpecrlWorkerExtension",
                           disable_log_stats=False, enable_prefix_caching=False, **speculative)


def _drafter_dir(start: StartWeights, settings: Settings, base: Path) -> Path | None:
    """-> the start drafter as a specrl drafter directory (a day-0 head is built and saved), or None."""
    if not start.has_drafter:
        return None
    if start.drafter == DAY0:
        from specrl.models.llama import load_llama

        out = Path(tempfile.mkdtemp(prefix="specrl-day0-"))
        build_drafter(DAY0, load_llama(base), settings).save(out)
        return out
    return Path(start.drafter)
