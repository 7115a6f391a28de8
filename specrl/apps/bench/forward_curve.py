"""The forward cost curve: ms of one target forward (all layers + the output head over every row,
KV cache at a fixed context) per batch size B and positions per row T.

Decoding is memory-bound, so a verify over T positions, or a batch of B rows, should cost about
what one position costs; this curve shows how far each (B, T) is from that, per dtype. Timings
go round-robin over the (B, T) grid, repeat after repeat, so a slow spell of the machine spreads
over every point instead of landing on one.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

CONTEXT = 120  # tokens already in each row's KV cache


def forward_cost_curve(model, batch_sizes: list[int], positions: list[int], dtype_label: str,
                       repeats: int = 5, context: int = CONTEXT) -> list[dict]:
    """model: a Llama (plain or prepared) -> one row per (B, T): median and min ms of
    `model.logits(model(tokens [B, T], slots, start=context, cache))` over `repeats` runs, after
    one warm-up run per point."""
    cache = model.new_cache(max(batch_sizes), context + max(positions) + 1)
    grid = [(b, t) for b in batch_sizes for t in positions]
    times: dict[tuple[int, int], list[float]] = {point: [] for point in grid}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for b, t in grid:
                tokens = torch.zeros(b, t, dtype=torch.long)
                slots, start = torch.arange(b), torch.full((b,), context)
                started = time.perf_counter()
                model.logits(model(tokens, slots, start, cache))
                if rep:  # the first pass warms up (oneDNN builds a primitive per row count)
                    times[(b, t)].append((time.perf_counter() - started) * 1000)
    return [{"dtype": dtype_label, "batch": b, "tokens": t, "rows": b * t, "context": context,
             "median_ms": statistics.median(times[(b, t)]), "min_ms": min(times[(b, t)]),
             "repeats": repeats, "threads": torch.get_num_threads()} for b, t in grid]


def forward_split(model, dtype_label: str, repeats: int = 30, context: int = CONTEXT) -> dict | None:
    """What a B=1 decode token costs beyond reading the weights: one forward (as in the curve, B=1 T=1) and the
    same forward's matmuls alone (its own packed weights through the stream kernel, one row, no Python between
    them), alternating `repeats` times in this process -> {dtype, forward_ms, matmul_ms, outside_ms,
    matmul_gb_s, weight_bytes} (medians). None where a weight does not stream at one row."""
    from specrl.models.linear import KIND, PackedLinear, cpu_kernels

    weights = model.streamed_weights()
    if cpu_kernels is None or not all(isinstance(w, PackedLinear) and w.streams(1) for w in weights):
        return None
    calls = [(w, torch.randn(1, w.in_features), torch.empty(1, w.out_features)) for w in weights]
    cache = model.new_cache(1, context + 2)
    forward, matmuls = [], []
    with torch.inference_mode():
        for rep in range(repeats + 1):
            started = time.perf_counter()
            model.logits(model(torch.zeros(1, 1, dtype=torch.long), torch.arange(1), torch.full((1,), context), cache))
            middle = time.perf_counter()
            for w, x, out in calls:
                cpu_kernels.gemm(out.data_ptr(), x.data_ptr(), w.stored.data_ptr(), 1, w.in_features, w.out_features,
                                 KIND[w.stored.dtype], torch.get_num_threads(), *w.stream_args(1))
            if rep:
                forward.append((middle - started) * 1000)
                matmuls.append((time.perf_counter() - middle) * 1000)
    forward_ms, matmul_ms = statistics.median(forward), statistics.median(matmuls)
    nbytes = model.streamed_weight_bytes()
    return {"dtype": dtype_label, "forward_ms": forward_ms, "matmul_ms": matmul_ms, "outside_ms": forward_ms - matmul_ms,
            "matmul_gb_s": nbytes / matmul_ms / 1e6, "weight_bytes": nbytes, "repeats": repeats, "context": context}


def plot_forward_curve(rows: list[dict], path: Path) -> Path:
    """rows from forward_cost_curve (one or more dtypes) -> a PNG at `path`: median ms against
    rows B*T, one line per (dtype, B), and each dtype's floor at B=1 (floors.add_floors) where the rows carry it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {}
    for dtype_label, batch in dict.fromkeys((r["dtype"], r["batch"]) for r in rows):
        line = sorted((r for r in rows if r["dtype"] == dtype_label and r["batch"] == batch), key=lambda r: r["rows"])
        style = styles.setdefault(dtype_label, ["-", "--", ":", "-."][len(styles) % 4])
        drawn = ax.plot([r["rows"] for r in line], [r["median_ms"] for r in line], style, marker="o", ms=3,
                        label=f"{dtype_label} B={batch}")
        if batch == 1 and all("floor_ms" in r for r in line):  # floors.add_floors's, at B=1: a thin line below
            ax.plot([r["rows"] for r in line], [r["floor_ms"] for r in line], ":", color=drawn[0].get_color(),
                    lw=1, label=f"{dtype_label} floor (B=1)")
    ax.set_xlabel("rows per forward (B x T)")
    ax.set_ylabel("forward ms (median)")
    ax.set_title(f"target forward cost, context {rows[0]['context']}, {rows[0]['threads']} threads")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
