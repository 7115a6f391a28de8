"""The forward cost curve the engine benchmark shows: one row per (B, T), and a PNG."""

import torch

from specrl.apps.bench.forward_curve import forward_cost_curve, plot_forward_curve
from specrl.models.llama import load_llama


def test_forward_cost_curve_rows_and_plot(tiny_dir, tmp_path):
    model = load_llama(tiny_dir)
    rows = forward_cost_curve(model, [1, 2], [1, 3], "float32", repeats=2, context=8)
    assert [(r["batch"], r["tokens"], r["rows"]) for r in rows] == [(1, 1, 1), (1, 3, 3), (2, 1, 2), (2, 3, 6)]
    assert all(r["median_ms"] >= r["min_ms"] > 0 and r["dtype"] == "float32" and r["context"] == 8 for r in rows)
    assert rows[0]["threads"] == torch.get_num_threads()
    more = [dict(r, dtype="bfloat16") for r in rows]
    path = plot_forward_curve(rows + more, tmp_path / "curve" / "forward.png")
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
