"""`specrl bench kernels`: each kernel against its torch twin, side by side in one run.

Verification (B requests, K drafts, vocabulary V; a quarter of the rows greedy): the Triton
kernel (CUDA only), the torch twin, and the naive per-row loop (`rejection_sample_rowwise`);
plus the dispatch's input checks, timed alone, against the twin. The kernel's tokens are compared
with the twin's on the same inputs.
A plain sampled step's draw (B rows of V logits, temperature 1, no filters): torch's softmax and
`rejection_sample_torch` with no drafts against the C draw the engine takes there (`RowSampler.draw`), and how
often their tokens agree on the same uniforms (they differ only where a uniform falls within float rounding of a
boundary of the inverse CDF).
Drafter loss (N positions, hidden H, draft vocabulary V; a quarter as many rejected drafts as
positions): forward + backward (d hidden and d head) of the Triton kernels (CUDA only), the
chunked torch twin, and the materialised reference (plain autograd on [N, V] logits), with each
one's peak memory above its inputs: CUDA allocator peak on a GPU; on CPU the process's peak RSS
(reset through /proc/self/clear_refs before each run). Loss and gradients are compared.

The loss also runs at the drafter trainer's own shapes (`trainer_loss_shapes`: the settings' model,
positions per optimizer step and per example, draft vocabulary and the full one), so its memory
advantage is stated where it is used.

On CPU only the twins and references run; shapes whose estimated memory passes CPU_RAM_BUDGET or
whose estimated time (from a measured matmul rate) passes CPU_SECONDS_BUDGET are skipped, with
the reason in the table and the JSON. On a GPU every shape runs (an out-of-memory is reported as
such) and the loss runs in bfloat16 with TF32 matmuls allowed for the float32 chunks of the twin.
Times are medians over repeats of at least MIN_SECONDS (one warm-up first).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.config import Settings
from specrl.kernels import drafter_loss_reference, rejection_sample_rowwise, rejection_sample_torch, triton_available
from specrl.kernels import drafter_loss as loss_twin
from specrl.kernels.checks import check_verify_inputs
from specrl.speculation.sampling import RowSampler, SamplingParams

QUICK_VERIFY = [(8, 4, 4096), (64, 4, 4096), (64, 8, 32768)]
FULL_VERIFY = [(b, k, v) for v in (49152, 131072) for k in (4, 8) for b in (1, 16, 64, 256)]
DRAW_SHAPES = [(1, 49152), (8, 49152), (64, 49152)]  # (B, V): SmolLM2's vocabulary
QUICK_LOSS = [(512, 256, 4096), (1024, 512, 16384)]
FULL_LOSS = [(1024, 1024, 49152), (4096, 2048, 49152), (4096, 4096, 131072), (16384, 4096, 131072),
             (65536, 4096, 49152), (65536, 8192, 131072)]
CPU_RAM_BUDGET = 8 * 2 ** 30
CPU_SECONDS_BUDGET = 45.0
MIN_SECONDS = 0.3
REFERENCE_NV_COPIES = 6  # [N, V] float32 tensors alive at the reference's peak (logits, softmaxes, grads)


def register(sub) -> None:
    p = sub.add_parser("kernels", help="Triton kernels vs their torch twins (twins only on CPU)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-kernels-<time>)")
    p.add_argument("--quick", action="store_true", help="small shapes only")
    add_settings(p, *COMMON)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    run_kernel_bench(settings_from(args), quick=args.quick, out_dir=args.out)
    return 0


def run_kernel_bench(settings: Settings, quick: bool, out_dir: str | None, *,
                     verify_shapes: list[tuple[int, int, int]] | None = None,
                     loss_shapes: list[tuple[int, int, int]] | None = None,
                     draw_shapes: list[tuple[int, int]] | None = None) -> dict:
    """Measure every shape; print a table; write bench-kernels.json and .png -> the result."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_triton = device.type == "cuda" and triton_available()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    verify_shapes = verify_shapes or (QUICK_VERIFY if quick else FULL_VERIFY)
    loss_shapes = loss_shapes or trainer_loss_shapes(settings) + (QUICK_LOSS if quick else FULL_LOSS)
    rate = _matmul_rate(device)
    verify_rows = [_verify_row(b, k, v, device, use_triton) for b, k, v in _progress(verify_shapes, "verify")]
    draw_rows = [_draw_row(b, v) for b, v in _progress(draw_shapes or DRAW_SHAPES, "plain draw")]
    loss_rows = [_loss_row(n, h, v, device, use_triton, rate) for n, h, v in _progress(loss_shapes, "loss")]
    result = _result(settings, quick, device, use_triton, rate, verify_rows, loss_rows)
    result["draw"] = draw_rows
    out = Path(out_dir) if out_dir else settings.home / "reports" / f"bench-kernels-{stamp}"
    _print_tables(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out / "bench-kernels.png")
    print(f"report: {out / 'bench-kernels.json'}\nchart:  {out / 'bench-kernels.png'}")
    return result


# ---- verification ------------------------------------------------------------------------------

def verify_inputs(b: int, k: int, v: int, device: torch.device, seed: int = 0):
    """Target p = softmax(2 g), draft q = softmax(2 g + noise) (acceptance ~0.5-0.8), drafts ~ q,
    a quarter of the rows greedy -> the arguments of rejection_sample."""
    gen = torch.Generator(device=device).manual_seed(seed)
    p = torch.randn(b, k + 1, v, generator=gen, device=device).mul_(2)
    q = torch.randn(b, k, v, generator=gen, device=device).add_(p[:, :k]).softmax(-1)
    p = p.softmax(-1)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k)
    uniforms = torch.rand(b, k + 1, generator=gen, device=device)
    greedy = torch.rand(b, generator=gen, device=device) < 0.25
    return drafts, q, p, uniforms, greedy


def _verify_row(b: int, k: int, v: int, device: torch.device, use_triton: bool) -> dict:
    row = {"B": b, "K": k, "V": v}
    args = verify_inputs(b, k, v, device)
    row["twin_ms"] = _time(lambda: rejection_sample_torch(*args), device)
    row["rowwise_ms"] = _time(lambda: rejection_sample_rowwise(*args), device)
    row["checks_ms"] = _time(lambda: check_verify_inputs(*args), device)
    row["checks_over_twin"] = row["checks_ms"] / row["twin_ms"]
    row["rowwise_over_twin"] = row["rowwise_ms"] / row["twin_ms"]
    row["accepted_mean"] = float(rejection_sample_torch(*args)[0].float().mean())
    if use_triton:
        from specrl.kernels.verify_triton import rejection_sample_triton

        row["triton_ms"] = _time(lambda: rejection_sample_triton(*args), device)
        row["twin_over_triton"] = row["twin_ms"] / row["triton_ms"]
        twin, kernel = rejection_sample_torch(*args), rejection_sample_triton(*args)
        row["tokens_equal_rows"] = float((twin[1] == kernel[1]).all(1).float().mean())
    args = None  # free before the next shape
    _free(device)
    return row


def _draw_row(b: int, v: int) -> dict:
    """A plain sampled step's draw at temperature 1 on the CPU: torch's (softmax, then rejection_sample_torch with
    no drafts) against the C one (`RowSampler.draw`, where the C kernels are built); ms and agreement."""
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    logits, uniforms = torch.randn(b, v, generator=gen).mul_(3), torch.rand(b, generator=gen)
    sampler = RowSampler.of([SamplingParams(temperature=1.0)] * b, [torch.Generator() for _ in range(b)])
    no_drafts, greedy = torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, dtype=torch.bool)

    def twin() -> torch.Tensor:
        return rejection_sample_torch(no_drafts, None, sampler.probs(logits[:, None]), uniforms[:, None], greedy)[1][:, 0]

    row = {"B": b, "V": v, "twin_ms": _time(twin, cpu)}
    if sampler.draws_from_logits:
        row["c_ms"] = _time(lambda: sampler.draw(logits, uniforms), cpu)
        row["twin_over_c"] = row["twin_ms"] / row["c_ms"]
        row["tokens_equal"] = float((sampler.draw(logits, uniforms)[0] == twin()).float().mean())
    return row


# ---- drafter loss ------------------------------------------------------------------------------

def trainer_loss_shapes(settings: Settings) -> list[tuple[int, int, int]]:
    """The (N, H, V) of the drafter trainer's loss calls: one example's share of an optimizer step's
    positions (what one call sees) and a whole step's, over the draft vocabulary, then a step's over
    the full vocabulary (`--draft-vocab-size 0`). [] when the model is not fetched."""
    from specrl.assets import resolve_model
    from specrl.errors import SpecrlError
    from specrl.models.llama import LlamaConfig

    try:
        cfg = LlamaConfig.from_dir(resolve_model(settings.model, settings.home, fetch=False))
    except SpecrlError:
        return []
    draft_vocab = settings.draft_vocab_size or cfg.vocab_size
    per_example = max(1, settings.train_positions // settings.train_records)
    return [(per_example, cfg.hidden_size, draft_vocab), (settings.train_positions, cfg.hidden_size, draft_vocab),
            (settings.train_positions, cfg.hidden_size, cfg.vocab_size)]


def loss_inputs(n: int, h: int, v: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """hidden [N, H] ~ N(0, 1), head [V, H] ~ N(0, 9/H) (logits ~ N(0, 9)), target logits ~ N(0, 9),
    N/4 rejected (row, id) pairs -> the arguments of the loss (hidden and head require grad)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, device=device).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=gen, device=device).mul_(3 / h ** 0.5).to(dtype).requires_grad_()
    target = torch.randn(n, v, generator=gen, device=device).mul_(3).to(dtype)
    rows = torch.randint(0, n, (n // 4,), generator=gen, device=device)
    tokens = torch.randint(0, v, (n // 4,), generator=gen, device=device)
    return hidden, weight, target, rows, tokens


def _loss_row(n: int, h: int, v: int, device: torch.device, use_triton: bool, rate: float) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    row = {"N": n, "H": h, "V": v, "dtype": str(dtype).removeprefix("torch.")}
    size = torch.tensor([], dtype=dtype).element_size()
    inputs_bytes = (n * h + v * h + n * v) * size
    estimates = {"twin": inputs_bytes + (n * h + v * h) * (4 + size) + 8 * loss_twin.BLOCK_N * loss_twin.BLOCK_V * 4,
                 "reference": inputs_bytes + (n * h + v * h) * (4 + size) + REFERENCE_NV_COPIES * n * v * 4}
    seconds = 8 * n * h * v / rate  # 4 matmuls of 2 N H V flops
    row["estimated_seconds_twin"] = seconds
    impls = {"twin": loss_twin.drafter_loss, "reference": drafter_loss_reference}
    if use_triton:
        from specrl.kernels.drafter_loss_triton import drafter_loss_triton

        impls = {"triton": drafter_loss_triton, **impls}
    outputs = {}
    for name, fn in impls.items():
        skip = _cpu_skip(device, estimates.get(name, 0), seconds * (0.75 if name == "reference" else 1.0))
        if skip:
            row[f"{name}_skipped"] = skip
            continue
        try:
            args = loss_inputs(n, h, v, dtype, device)
            row[f"{name}_ms"], row[f"{name}_peak_bytes"], outputs[name] = _measure_loss(fn, args, device, seconds)
        except torch.OutOfMemoryError:
            row[f"{name}_skipped"] = "out of memory"
        finally:
            args = None
            _free(device)
    _ratios(row, outputs)
    return row


def _measure_loss(fn: Callable, args: tuple, device: torch.device, estimate_s: float):
    """-> (median ms of forward + backward, peak bytes above the inputs, (loss, d hidden, d head))."""
    hidden, weight = args[0], args[1]

    def step():
        hidden.grad = weight.grad = None
        loss = fn(*args, 0.5)
        loss.backward()
        return loss

    with _tf32(device):
        base = _memory_mark(device)
        started = time.perf_counter()
        loss = step()  # also the warm-up (and Triton's compilation)
        _sync(device)
        ms = (time.perf_counter() - started) * 1e3
        # at least 0: on CPU, Linux sums RSS from per-CPU counters, approximate by a few pages, so a step that
        # allocates nothing new may read a peak a few KiB below the mark (CI: -56 KiB)
        peak = max(0, _memory_peak(device) - base)
        if estimate_s < 10:  # else a big shape on CPU: the first run is the measurement
            ms = _time(step, device, warmup=False)
    return ms, peak, (loss.detach().float(), hidden.grad.float(), weight.grad.float())


def _ratios(row: dict, outputs: dict) -> None:
    if "reference_ms" in row:
        row["reference_over_twin"] = row["reference_ms"] / row["twin_ms"] if "twin_ms" in row else None
    if "triton_ms" in row and "twin_ms" in row:
        row["twin_over_triton"] = row["twin_ms"] / row["triton_ms"]
    base = outputs.get("twin")
    for name in ("triton", "reference"):
        if base is not None and name in outputs:
            row[f"{name}_max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
                                              for a, b in zip(outputs[name], base))


def _cpu_skip(device: torch.device, estimate_bytes: int, estimate_s: float) -> str | None:
    if device.type != "cpu":
        return None
    if estimate_bytes > CPU_RAM_BUDGET:
        return f"~{estimate_bytes / 2 ** 30:.1f} GiB > {CPU_RAM_BUDGET / 2 ** 30:.0f} GiB CPU budget"
    if estimate_s > CPU_SECONDS_BUDGET:
        return f"~{estimate_s:.0f} s > {CPU_SECONDS_BUDGET:.0f} s CPU budget"
    return None


# ---- measuring ---------------------------------------------------------------------------------

def _time(fn: Callable, device: torch.device, warmup: bool = True) -> float:
    """Median milliseconds of fn over repeats lasting at least MIN_SECONDS (3 repeats at least)."""
    if warmup:
        fn()
    times = []
    while len(times) < 3 or sum(times) < MIN_SECONDS * 1e3:
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - started) * 1e3)
        if len(times) >= 200:
            break
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _memory_mark(device: torch.device) -> int:
    """Reset the peak counter -> the memory in use now (bytes)."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS (Linux >= 4.0)
    except OSError:
        return 0
    return _proc_status_kib("VmRSS") * 1024


def _memory_peak(device: torch.device) -> int:
    _sync(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_kib("VmHWM") * 1024


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class _tf32:
    """TF32 matmuls on CUDA inside the block (the twin's float32 chunks of bfloat16 inputs)."""

    def __init__(self, device: torch.device):
        self.on, self.saved = device.type == "cuda", torch.backends.cuda.matmul.allow_tf32

    def __enter__(self):
        if self.on:
            torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def _matmul_rate(device: torch.device) -> float:
    """float32 matmul flop/s of this device (best of 3, 2048^3), for the CPU time estimates."""
    a = torch.randn(2048, 2048, device=device)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        started = time.perf_counter()
        a @ a
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * 2048 ** 3 / best


def _progress(items: list, what: str):
    from tqdm import tqdm

    return tqdm(items, desc=f"bench kernels: {what}", file=sys.stderr, leave=False)


# ---- report ------------------------------------------------------------------------------------

def _result(settings: Settings, quick: bool, device: torch.device, use_triton: bool, rate: float,
            verify_rows: list[dict], loss_rows: list[dict]) -> dict:
    triton_version = None
    if triton_available():
        import importlib.metadata

        triton_version = importlib.metadata.version("triton")
    notes = []
    if not use_triton:
        notes.append("twins only: Triton kernels need a CUDA device"
                     + ("" if device.type == "cuda" else "; H200 figures: docs/results/2026-12-04-h200-triton-kernels.md"))
    return {
        "command": sys.argv, "timestamp": datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": quick, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "triton": triton_version, "triton_used": use_triton, "matmul_flops_per_s": rate,
        "home": str(settings.home), "cpu_ram_budget_bytes": CPU_RAM_BUDGET, "cpu_seconds_budget": CPU_SECONDS_BUDGET,
        "verify": verify_rows, "loss": loss_rows, "notes": notes,
    }


def _fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _print_tables(result: dict) -> None:
    print(f"device: {result['device']} ({result['threads']} threads), torch {result['torch']}, "
          f"triton {result['triton'] or 'not installed'}{'' if result['triton_used'] else ' (not used)'}")
    print(f"{'verify':<8} {'B':>4} {'K':>2} {'V':>7} {'triton ms':>10} {'twin ms':>9} {'loop ms':>9} "
          f"{'loop/twin':>9} {'twin/tri':>8} {'checks ms':>9} {'checks':>7} {'acc':>5}")
    for r in result["verify"]:
        print(f"{'':<8} {r['B']:>4} {r['K']:>2} {r['V']:>7} {_fmt(r.get('triton_ms'), '.3f'):>10} "
              f"{r['twin_ms']:>9.3f} {r['rowwise_ms']:>9.2f} {r['rowwise_over_twin']:>8.1f}x "
              f"{_fmt(r.get('twin_over_triton'), '.1f'):>7}x {r['checks_ms']:>9.3f} {r['checks_over_twin']:>7.0%} "
              f"{r['accepted_mean']:>5.2f}")
    print(f"{'loss':<6} {'N':>6} {'H':>5} {'V':>7} {'triton ms':>10} {'twin ms':>10} {'ref ms':>10} {'ref/twin':>8} "
          f"{'twin/tri':>8} {'peak MiB tri/twin/ref':>24}")
    for r in result["loss"]:
        peaks = "/".join(_fmt(r.get(f"{k}_peak_bytes") and r[f"{k}_peak_bytes"] / 2 ** 20, ".0f")
                         for k in ("triton", "twin", "reference"))
        print(f"{'':<6} {r['N']:>6} {r['H']:>5} {r['V']:>7} {_fmt(r.get('triton_ms'), '.1f'):>10} "
              f"{_fmt(r.get('twin_ms'), '.1f'):>10} {_fmt(r.get('reference_ms'), '.1f'):>10} "
              f"{_fmt(r.get('reference_over_twin'), '.2f'):>7}x {_fmt(r.get('twin_over_triton'), '.2f'):>7}x "
              f"{peaks:>24}")
        for name in ("triton", "twin", "reference"):
            if f"{name}_skipped" in r:
                print(f"{'':<6} {'':>6} {'':>5} {'':>7}   {name} skipped: {r[f'{name}_skipped']}")
    print(f"{'draw':<8} {'B':>4} {'V':>7} {'twin ms':>9} {'C ms':>9} {'twin/C':>7} {'same':>6}")
    for r in result.get("draw", []):
        print(f"{'':<8} {r['B']:>4} {r['V']:>7} {r['twin_ms']:>9.3f} {_fmt(r.get('c_ms'), '.3f'):>9} "
              f"{_fmt(r.get('twin_over_c'), '.1f'):>6}x {_fmt(r.get('tokens_equal'), '.0%'):>6}")
    for note in result["notes"]:
        print(f"note: {note}")


def _plot(result: dict, path: Path) -> None:
    """Left: verification ms per shape (log scale); right: loss ms and peak MiB per shape."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8))
    left, mid, right = fig.subplots(1, 3)
    for ax, rows, label, keys in (
            (left, result["verify"], lambda r: f"B{r['B']} K{r['K']}\nV{r['V'] // 1024}k",
             ("triton_ms", "twin_ms", "rowwise_ms")),
            (mid, result["loss"], lambda r: f"N{r['N'] // 1024 or r['N']}k H{r['H']}\nV{r['V'] // 1024}k",
             ("triton_ms", "twin_ms", "reference_ms")),
            (right, result["loss"], lambda r: f"N{r['N'] // 1024 or r['N']}k H{r['H']}\nV{r['V'] // 1024}k",
             ("triton_peak_bytes", "twin_peak_bytes", "reference_peak_bytes"))):
        keys = [k for k in keys if any(r.get(k) for r in rows)]
        width = 0.8 / max(1, len(keys))
        for i, key in enumerate(keys):
            scale = 2 ** -20 if key.endswith("bytes") else 1
            ax.bar([j + (i - (len(keys) - 1) / 2) * width for j in range(len(rows))],
                   [(r.get(key) or 0) * scale for r in rows], width, label=key.split("_")[0])
        ax.set_xticks(range(len(rows)), [label(r) for r in rows], fontsize=6, rotation=90)
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    left.set_title("verification, ms")
    mid.set_title("drafter loss fwd+bwd, ms")
    right.set_title("drafter loss peak MiB above inputs")
    used = "used" if result["triton_used"] else "not used"
    fig.suptitle(f"{result['device']}, torch {result['torch']}, triton {used}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
