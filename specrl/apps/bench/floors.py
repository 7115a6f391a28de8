"""The floors under a forward's cost, measured on the machine itself: what no kernel can beat here.

For one target forward over B sequences x T positions each (a point of the forward cost curve):
- bytes floor: the bytes the forward must read, over the machine's measured read bandwidth
  (`backends.read_bandwidth_gb_s`): every streamed weight once (`Llama.streamed_weight_bytes`: the layers'
  linears and the output head) plus each sequence's KV cache up to the curve's context (B x context x the
  cache's bytes a position);
- compute floor: the multiply-adds of the forward's linears (B x T rows x every streamed weight's
  in x out; attention's few are left out) over the measured peak rate of the instruction the dtype's kernel
  multiplies with, on the same threads (`_cpu_peak.c`: a loop of that instruction alone; for AMX, of full
  16-row tiles, so under 16 rows the compute floor is optimistic).
The floor is the larger of the two; a point reads as its median over the floor ("1.8x of its floor").
At one row the bytes floor decides; past a few rows the compute floor does, and how fast it rises with rows
says how much room a kernel has to make extra positions nearly free.

The instruction is the one `_cpu_kernels.path` says the dtype's weights take on this CPU: float32 and
float16 weights FMA (AVX2 or AVX-512), int8 and q4 integer dot products (AVX2's VPMADDUBSW + VPMADDWD or
AVX-512 VNNI's VPDPBUSD, or AMX-INT8's TDPBSUD), bfloat16 VDPBF16PS or AMX-BF16's TDPBF16PS. A weight outside
the stream kernel gets the bytes floor only (`instruction` None).
"""

from __future__ import annotations

import time

import torch

from specrl.models.linear import KIND, PackedLinear, cpu_kernels

# _cpu_kernels.path's answer for a weight kind -> the instruction _cpu_peak.c times
_FLOAT_KINDS, _INT_KINDS = (KIND[torch.float32], KIND[torch.float16]), (KIND[torch.int8], KIND[torch.uint8])
_INSTRUCTION = {("avx2", _FLOAT_KINDS): "avx2_fma", ("avx512f", _FLOAT_KINDS): "avx512_fma",
                ("avx2", _INT_KINDS): "avx2_int8", ("avx512_vnni", _INT_KINDS): "avx512_vnni",
                ("avx512_bf16", (KIND[torch.bfloat16],)): "avx512_bf16", ("amx", (KIND[torch.bfloat16],)): "amx_bf16",
                ("amx_int8", _INT_KINDS): "amx_int8"}


def kernel_instruction(model, rows: int = 1) -> str | None:
    """The instruction the model's streamed weights multiply with on this CPU at `rows` rows (the path of the call
    the first linear takes there: int8 and q4 may take AMX-INT8 tiles from some row count on), or None where the
    peak of that path is not measured here."""
    weight = model.streamed_weights()[0]
    if cpu_kernels is None or not isinstance(weight, PackedLinear):
        return None
    kind = KIND[weight.stored.dtype]
    path = cpu_kernels.path(weight.out_features, kind, weight.in_features, weight.stream_args(rows)[0])
    return next((name for (p, kinds), name in _INSTRUCTION.items() if p == path and kind in kinds), None)


def forward_work(model, dtype_label: str, rows: tuple[int, ...] = ()) -> dict:
    """What a forward of `model` must read and compute, per dtype: {dtype, weight_bytes, kv_bytes_per_position,
    macs_per_row, instruction (at one row), instruction_by_rows (at each of `rows`)}."""
    cfg = model.cfg
    shapes = [w.shape if isinstance(w, PackedLinear) else tuple(w.shape) for w in model.streamed_weights()]
    element = torch.empty((), dtype=model.dtype).element_size()  # the KV cache holds the model's dtype
    return {"dtype": dtype_label, "weight_bytes": model.streamed_weight_bytes(),
            "kv_bytes_per_position": cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element,
            "macs_per_row": sum(out * inp for out, inp in shapes), "instruction": kernel_instruction(model),
            "instruction_by_rows": {r: kernel_instruction(model, r) for r in rows}}


# A peak is measured at PEAK_SAMPLES moments PEAK_PAUSE_S apart and the best kept: a neighbour that takes one of
# the machine's cores for a moment halves a rate measured on every core, and a floor must not rise with it (AVX-512
# EPYC, 2 threads: one `bench engine` run read VPDPBUSD at 235 G multiply-adds/s, the same call 434-469 G before
# and after it, so every int8 and q4 point read half as far from its compute floor as it was).
PEAK_SAMPLES = 3
PEAK_PAUSE_S = 0.5


def peak_rates(instructions, threads: int, samples: int = PEAK_SAMPLES, pause_s: float = PEAK_PAUSE_S) -> dict[str, float]:
    """instruction -> multiply-adds a second on `threads` threads (the best of `samples` measurements `pause_s`
    apart, each the best of 3 runs of >= 20 ms), for each name this CPU runs."""
    names = list(dict.fromkeys(i for i in instructions if i))
    if cpu_kernels is None:
        return {}
    best = {name: -1.0 for name in names}
    for sample in range(samples):
        if sample:
            time.sleep(pause_s)
        for name in names:
            best[name] = max(best[name], cpu_kernels.peak_macs(name, threads))
    return {name: rate for name, rate in best.items() if rate > 0}


def add_floors(points: list[dict], work: dict[str, dict], read_gb_s: float, peaks: dict[str, float]) -> list[dict]:
    """Curve points (forward_curve.forward_cost_curve's rows) -> the same with bytes_floor_ms, compute_floor_ms
    (None where the instruction's peak is not measured), floor_ms and of_floor (median_ms / floor_ms)."""
    out = []
    for p in points:
        w = work[p["dtype"]]
        nbytes = w["weight_bytes"] + p["batch"] * p["context"] * w["kv_bytes_per_position"]
        bytes_ms = nbytes / (read_gb_s * 1e9) * 1e3
        instruction = w.get("instruction_by_rows", {}).get(p["rows"], w["instruction"])
        peak = peaks.get(instruction)
        compute_ms = p["rows"] * w["macs_per_row"] / peak * 1e3 if peak else None
        floor_ms = max(bytes_ms, compute_ms or 0.0)
        out.append({**p, "bytes_floor_ms": bytes_ms, "compute_floor_ms": compute_ms, "floor_ms": floor_ms,
                    "of_floor": p["median_ms"] / floor_ms, "instruction": instruction})
    return out


def print_floors(curve: dict) -> None:
    """The forward cost curve against its floors, one block per dtype: ms and x of the floor per (B, T), and
    which floor decides (b: bytes, c: compute)."""
    peaks = curve.get("peak_macs_per_s", {})
    print(f"floors: read {curve['read_gb_s']:.1f} GB/s; peaks " +
          (", ".join(f"{name} {rate / 1e9:.0f} G multiply-adds/s" for name, rate in peaks.items()) or "none measured"))
    for dtype in dict.fromkeys(p["dtype"] for p in curve["rows"]):
        points = [p for p in curve["rows"] if p["dtype"] == dtype and "floor_ms" in p]
        if not points:
            continue
        instructions = ", ".join(dict.fromkeys(p["instruction"] or "no peak" for p in points))
        print(f"forward ms ({dtype}, {instructions}), x of its floor (b: bytes decide, c: compute):")
        for batch in dict.fromkeys(p["batch"] for p in points):
            cells = [f"T={p['tokens']} {p['median_ms']:.2f} {p['of_floor']:.2f}x"
                     f"{'c' if (p['compute_floor_ms'] or 0) > p['bytes_floor_ms'] else 'b'}"
                     for p in points if p["batch"] == batch]
            print(f"  B={batch}: " + ", ".join(cells))
