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


def test_forward_split_times_a_forward_against_its_own_matmuls(tiny_dir):
    """int8 weights, every one streaming: the split's matmuls are the model's own weights (their bytes), the
    rest is the forward's time beyond them. A model whose weights do not all stream has no split."""
    import pytest

    from specrl.apps.bench.forward_curve import forward_split
    from specrl.models.linear import cpu_kernels
    from tests.models.test_prepared import ForcedPlan

    assert forward_split(load_llama(tiny_dir), "float32", repeats=2, context=8) is None  # plain weights
    if cpu_kernels is None:
        pytest.skip("the stream kernel is not built")
    model = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, torch.int8))
    split = forward_split(model, "int8", repeats=3, context=8)
    assert split["dtype"] == "int8" and split["weight_bytes"] == model.streamed_weight_bytes() > 0
    assert split["forward_ms"] > 0 and split["matmul_ms"] > 0
    assert split["outside_ms"] == pytest.approx(split["forward_ms"] - split["matmul_ms"])
    assert split["matmul_gb_s"] == pytest.approx(split["weight_bytes"] / split["matmul_ms"] / 1e6)


def test_step_split_times_the_engine_step_against_its_bare_forward(make_engine):
    """A plain engine's decode steps after the first token, against as many bare forwards of its own model at the
    same positions: the split's parts add up, and the engine is left with no work (every request finished)."""
    import pytest

    from specrl.apps.bench.step_split import step_split

    engine = make_engine(drafter="none", suffix_capacity=0)
    split = step_split(engine, [5, 9, 2, 7], "float32", tokens=6, repeats=2)
    assert split["dtype"] == "float32" and split["tokens"] == 6 and split["repeats"] == 2
    assert split["step_ms"] > 0 and split["forward_ms"] > 0
    assert split["outside_ms"] == pytest.approx(split["step_ms"] - split["forward_ms"])
    assert not engine.has_work()
