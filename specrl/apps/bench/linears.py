"""`specrl bench linears`: the project's stream kernel beside what torch and torchao offer for the same
weight format, on SmolLM2's linear shapes at the row counts a decode or verify step has.

Why: before a kernel of our own serves a format, the well-kept libraries' calls are measured on the
same shapes (int8: torch's `aten._weight_int8pack_mm`, torchao's int8 weight-only and dynamic-activation
layouts when torchao is importable (it is not a dependency: `pip install torchao` to include it); 4-bit:
torch's `aten._weight_int4pack_mm_for_cpu` on the same Q4_1 values). Each
candidate packs SmolLM2's four layer weights (qkv [1728, 576], o [576, 576], gate_up [3072, 576], down
[576, 1536]) and the head [49152, 576] once per copy of a ring larger than the L3 (so every call streams
its weight from memory, as a forward does), and is timed at each row count: ms for one forward's
matmuls (30 layers + the head), and at one row the weight bytes read per second.

Table, JSON (`bench-linears.json`) and PNG (`bench-linears.png`) under <home>/reports/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.config import Settings
from specrl.errors import InvalidRequestError

LAYER_SHAPES = {"qkv": (1728, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
LAYERS = 30  # SmolLM2-135M
DEFAULT_ROWS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Candidate:
    """One way to serve a weight format: `pack` a float32 weight [OUT, IN] once, `call(x2 [M, IN], packed)`."""

    name: str
    format: str
    pack: Callable[[torch.Tensor], object]
    call: Callable[[torch.Tensor, object], torch.Tensor]
    bytes_per_weight: float  # scales included


def register(sub) -> None:
    p = sub.add_parser("linears", help="the stream kernel beside torch's and torchao's calls, per weight format")
    p.add_argument("--formats", default="float32,bfloat16,int8", help="weight formats (default float32,bfloat16,int8)")
    p.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="row counts (default 1,2,4,8,16)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-linears-<time>)")
    add_settings(p, *COMMON)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        rows = tuple(int(r) for r in args.rows.split(",") if r.strip())
    except ValueError:
        rows = ()
    if not rows or min(rows) < 1:
        raise InvalidRequestError(f"--rows takes positive row counts like 1,2,4,8,16; got {args.rows!r}")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise InvalidRequestError(f"--formats takes some of {', '.join(FORMATS)}; got {args.formats!r}")
    run_linears_bench(settings_from(args), formats, rows, args.out)
    return 0


def candidates(fmt: str) -> list[Candidate]:
    """Every call this process can run for `fmt` (the project's first)."""
    return [c for c in FORMATS[fmt]() if c is not None]


def _stream(fmt: str, call: str = "stream") -> Candidate | None:
    """The stream kernel through `call` ("stream"; int8 and q4 also "stream prefetch" and, where the CPU has
    AMX-INT8, "stream amx", which the calibration times beside it on each machine)."""
    from specrl.models.calibration import DTYPES, convert
    from specrl.models.linear import CALLS, NATIVE_BF16, PackedLinear, cpu_kernels
    from specrl.models.quantize import bytes_per_weight

    if cpu_kernels is None or (fmt == "bfloat16" and not NATIVE_BF16) or not CALLS[call].dtypes:
        return None
    dtype = DTYPES[fmt]
    return Candidate(f"{call} {fmt} (specrl)", fmt, lambda w: PackedLinear(convert(w, dtype), "blocked", (1,), (call,)),
                     lambda x2, packed: packed(x2), bytes_per_weight(dtype))


def _float_formats(fmt: str) -> Callable[[], list]:
    def made() -> list:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[fmt]
        library = Candidate(f"F.linear {fmt} (torch)", fmt, lambda w: w.to(dtype).contiguous(),
                            lambda x2, w: torch.nn.functional.linear(x2.to(w.dtype), w),
                            torch.empty(0, dtype=dtype).element_size())
        return [_stream(fmt), library]
    return made


def _int8() -> list:
    def int8pack(w: torch.Tensor):  # its API takes one scale per output
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    found = [_stream("int8"), _stream("int8", "stream prefetch"), _stream("int8", "stream amx"),
             Candidate("aten._weight_int8pack_mm (torch)", "int8", int8pack,
                       lambda x2, p: torch.ops.aten._weight_int8pack_mm(x2, p[0], p[1]), 1 + 4 / 576)]
    return found + _torchao_int8()


def _torchao_int8() -> list:
    try:
        from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig,
                                          quantize_)
    except ImportError:
        return []

    def packer(config):
        def pack(w: torch.Tensor):
            layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                layer.weight.copy_(w)
            quantize_(layer, config())
            return layer
        return pack

    return [Candidate("int8 weight-only (torchao)", "int8", packer(Int8WeightOnlyConfig), lambda x2, m: m(x2),
                      1 + 4 / 576),
            Candidate("int8 dynamic activations (torchao)", "int8", packer(Int8DynamicActivationInt8WeightConfig),
                      lambda x2, m: m(x2), 1 + 4 / 576)]


def _q4() -> list:
    from specrl.models.quantize import GROUP, Q4Weight

    def int4pack(w: torch.Tensor):
        """torch's CPU int4 layout: w = (q - 8) * scale + zero per group of 32; Q4_1's d q + m is that with
        zero = m + 8 d (the same 4-bit values)."""
        q = Q4Weight.from_float(w)
        scale, minimum = q.scale.float().t(), q.minimum.float().t()  # [IN/32, OUT]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.q.to(torch.int32), 1)
        return packed, torch.stack([scale, minimum + 8 * scale], dim=-1).contiguous()

    return [_stream("q4"), _stream("q4", "stream prefetch"), _stream("q4", "stream amx"),
            Candidate("aten._weight_int4pack_mm_for_cpu (torch)", "q4", int4pack,
                      lambda x2, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x2, p[0], GROUP, p[1]), 0.5 + 8 / GROUP)]


FORMATS = {"float32": _float_formats("float32"), "bfloat16": _float_formats("bfloat16"),
           "float16": _float_formats("float16"), "int8": _int8, "q4": _q4}


def run_linears_bench(settings: Settings, formats: list[str], rows: tuple[int, ...], out_dir: str | None) -> dict:
    from specrl.apps.bench.backends import machine_record, save_report

    results = []
    for fmt in formats:
        for candidate in candidates(fmt):
            _progress(f"{candidate.name}")
            results.append({"name": candidate.name, "format": fmt, "bytes_per_weight": candidate.bytes_per_weight,
                            **_measure(candidate, rows)})
    result = {"command": sys.argv, "machine": machine_record(), "rows": list(rows), "layers": LAYERS,
              "shapes": {**LAYER_SHAPES, "head": HEAD_SHAPE}, "torchao": _torchao_version(), "candidates": results}
    save_report(result, "bench-linears", out_dir, settings.home, _print_table, _plot)
    return result


def _measure(candidate: Candidate, rows: tuple[int, ...]) -> dict:
    """ms of one forward's matmuls per row count (30 layers' four weights + the head), each shape timed
    over a ring of packed copies that passes the L3."""
    from specrl.models.calibration import l3_bytes, return_freed_memory, ring_copies

    gen = torch.Generator().manual_seed(0)
    per_shape: dict[str, list[float]] = {}
    with torch.inference_mode():
        for name, shape in {**LAYER_SHAPES, "head": HEAD_SHAPE}.items():
            weight = torch.randn(shape, generator=gen).mul_(0.02)
            copies = ring_copies(int(weight.numel() * candidate.bytes_per_weight), l3_bytes())
            ring = [candidate.pack(weight) for _ in range(copies)]
            per_shape[name] = [_time(candidate.call, torch.randn(m, shape[1], generator=gen), ring) for m in rows]
            del ring
            return_freed_memory()
    layer = [sum(per_shape[n][i] for n in LAYER_SHAPES) for i in range(len(rows))]
    forward = [LAYERS * layer[i] + per_shape["head"][i] for i in range(len(rows))]
    weights = LAYERS * sum(o * i for o, i in LAYER_SHAPES.values()) + HEAD_SHAPE[0] * HEAD_SHAPE[1]
    return {"forward_ms": forward, "per_shape_ms": per_shape,
            "gb_s_one_row": weights * candidate.bytes_per_weight / (forward[0] / 1000) / 1e9 if 1 in rows[:1] else None}


def _time(call, x2: torch.Tensor, ring: list, repeats: int = 7) -> float:
    """ms: the median of a few calls after one warm-up, each on the ring's next copy."""
    call(x2, ring[0])
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        call(x2, ring[(i + 1) % len(ring)])
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def _progress(message: str) -> None:
    print(f"bench linears: {message}", file=sys.stderr, flush=True)


def _print_table(result: dict) -> None:
    from specrl.apps.bench.backends import machine_line

    print(f"machine: {machine_line(result['machine'])}; torchao {result['torchao'] or 'not installed'}")
    print(f"ms for one SmolLM2 forward's matmuls ({result['layers']} layers + head), by rows:")
    print(f"{'call':<38} " + " ".join(f"{'M=' + str(m):>8}" for m in result["rows"]) + f" {'GB/s @1':>8}")
    for c in result["candidates"]:
        gb = f"{c['gb_s_one_row']:>8.1f}" if c["gb_s_one_row"] else f"{'-':>8}"
        print(f"{c['name']:<38} " + " ".join(f"{ms:>8.2f}" for ms in c["forward_ms"]) + f" {gb}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for c in result["candidates"]:
        ax.plot(result["rows"], c["forward_ms"], marker="o", label=c["name"],
                linestyle="-" if "specrl" in c["name"] else "--")
    ax.set_xlabel("rows (B x T)")
    ax.set_ylabel("ms, one forward's matmuls (log)")
    ax.set_yscale("log")
    ax.set_title(f"SmolLM2 linears, {result['machine']['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
