"""`specrl bench engine` on the tiny model: the report's structure, its ratios, its chart."""

import json

import matplotlib.image
import pytest

from specrl.apps.bench.engine import (CURVE_BATCHES, CURVE_POSITIONS, HF, NATIVE_PLAIN, NATIVE_SPEC, RSS_HEADROOM,
                                      native_dtypes, run_engine_bench)
from specrl.apps.bench.vllm_engine import DTYPE_SUFFIX
from specrl.config import Settings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bench_engine_writes_json_and_png(tmp_path, capsys):
    settings = Settings.load(model="tiny-random")
    result = run_engine_bench(settings, [1, 2], 8, str(tmp_path))

    report = json.loads((tmp_path / "bench-engine.json").read_text())
    assert report["batch_sizes"] == [1, 2] and report["new_tokens"] == 8
    assert report["model"] == "tiny-random" and report["threads"] >= 1 and report["command"]
    assert report["backends"] == ["native"] and report["vllm"]["measured"] is False
    rows = {(r["engine"], r["batch_size"]): r for r in report["rows"]}
    dtypes = native_dtypes()
    assert dtypes[0] == "float32" and set(dtypes) <= set(DTYPE_SUFFIX)
    assert set(rows) == {(e + DTYPE_SUFFIX[d], b) for e in (NATIVE_PLAIN, NATIVE_SPEC) for d in dtypes
                         for b in (1, 2)} | {(HF, 1), (HF, 2)}
    assert {r["dtype"] for r in report["rows"] if r["engine"] != HF} == set(dtypes)
    for (engine, b), row in rows.items():
        assert row["tokens"] == b * 8
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        if engine == HF:
            assert row["ttft_ms"] is None  # generate returns at the end
        else:
            assert 0 < row["ttft_ms"] <= row["ttft_ms_max"] <= row["seconds"] * 1000
            assert row["decode_tokens_per_s"] is None or row["decode_tokens_per_s"] > 0
    for b in (1, 2):
        spec = rows[NATIVE_SPEC, b]
        assert spec["tokens_per_step"] >= 1.0 and 0.0 <= spec["acceptance_rate"] <= 1.0
        ratio = report["ratios"][str(b)]
        assert ratio["native_plain_over_hf"] == pytest.approx(
            rows[NATIVE_PLAIN, b]["tokens_per_s"] / rows[HF, b]["tokens_per_s"])
        assert ratio["native_spec_over_native_plain"] == pytest.approx(
            spec["tokens_per_s"] / rows[NATIVE_PLAIN, b]["tokens_per_s"])

    bandwidth, memory = report["bandwidth"], report["memory"]
    weight_bytes = bandwidth["weight_bytes_per_forward"]
    assert bandwidth["read_gb_s"] > 0 and set(weight_bytes) == set(dtypes) and min(weight_bytes.values()) > 0
    for dtype, nbytes in weight_bytes.items():
        assert bandwidth["bound_tokens_per_s_batch1"][dtype] == pytest.approx(bandwidth["read_gb_s"] * 1e9 / nbytes)
    if "float16" in weight_bytes:  # half the bytes streamed (the fp32 embedding lookup aside, the head is tied)
        assert weight_bytes["float16"] < 0.6 * weight_bytes["float32"]
    assert set(bandwidth["achieved_over_bound_batch1"]) == {e for e, b in rows if b == 1}
    assert bandwidth["achieved_over_bound_batch1"][NATIVE_PLAIN] == pytest.approx(
        rows[NATIVE_PLAIN, 1]["tokens_per_s"] / bandwidth["bound_tokens_per_s_batch1"]["float32"])
    assert memory["peak_rss_bytes"] > 0 and memory["model_bytes"] > 0
    assert memory["limit_bytes"] == int((memory["model_bytes"] + memory["kv_cache_bytes_total"]) * RSS_HEADROOM)
    assert result["ratios"] == report["ratios"]
    assert report["cpu"]["model"] and isinstance(report["cpu"]["flags"], list)
    curve = report["forward_curve"]
    assert {(r["batch"], r["tokens"], r["dtype"]) for r in curve["rows"]} == {
        (b, t, d) for b in CURVE_BATCHES for t in CURVE_POSITIONS for d in dtypes}
    assert {r["dtype"] for r in curve["rows"]} == set(dtypes) and all(r["median_ms"] >= r["min_ms"] > 0 for r in curve["rows"])
    ms = {(r["batch"], r["tokens"]): r["median_ms"] for r in curve["rows"] if r["dtype"] == "float32"}
    assert curve["ratios"]["float32"]["b1_t5_over_b1_t1"] == pytest.approx(ms[1, 5] / ms[1, 1])
    assert (tmp_path / "forward-curve.png").read_bytes()[:8] == PNG_SIGNATURE
    steps = report["step_split"]  # a plain B=1 step against its bare forward, per dtype
    assert [s["dtype"] for s in steps] == dtypes and all(s["step_ms"] > 0 and s["forward_ms"] > 0 for s in steps)
    assert curve["read_gb_s"] == bandwidth["read_gb_s"] and set(curve["work"]) == set(dtypes)
    for r in curve["rows"]:  # each point against its floors (floors.py; the arithmetic: tests/bench/test_floors.py)
        work = curve["work"][r["dtype"]]
        instruction = work["instruction_by_rows"][str(r["rows"])]  # the call its row count takes (JSON keys)
        assert r["instruction"] == instruction and r["bytes_floor_ms"] > 0
        assert (r["compute_floor_ms"] is None) == (instruction not in curve["peak_macs_per_s"])
        assert r["floor_ms"] == max(r["bytes_floor_ms"], r["compute_floor_ms"] or 0)
        assert r["of_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"])
    passes = {(r["dtype"], r["batch"]): r for r in report["draft_pass"]}  # the head's pass against a plain step
    assert set(passes) == {(d, b) for d in dtypes for b in (1, 2)}
    for r in passes.values():
        assert r["draft_pass_ms"] > 0 and r["target_step_ms"] > 0
        assert r["pass_over_step"] == pytest.approx(r["draft_pass_ms"] / r["target_step_ms"])
        assert 0 < r["drafter_weight_bytes"] < r["target_weight_bytes"]

    png = tmp_path / "bench-engine.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(png).shape  # decodes the whole image
    assert height > 100 and width > 100
    out = capsys.readouterr().out
    assert "native_plain" in out and str(tmp_path / "bench-engine.json") in out and "x of its floor" in out
    assert "drafter pass (float32, B=2" in out


def test_ratios_vllm_over_native_only_where_both_ran():
    from specrl.apps.bench.engine import engine_ratios
    from specrl.apps.bench.vllm_engine import VLLM_PLAIN, VLLM_SPEC

    def row(engine, b, tps, ttft):
        return {"engine": engine, "batch_size": b, "tokens_per_s": tps, "decode_tokens_per_s": 2 * tps, "ttft_ms": ttft}

    rows = [row(NATIVE_PLAIN, 1, 40.0, 50.0), row(NATIVE_SPEC, 1, 20.0, 60.0), row(HF, 1, 10.0, None),
            row(VLLM_PLAIN, 1, 10.0, 100.0), row(VLLM_SPEC, 1, 5.0, 30.0), row(NATIVE_PLAIN, 8, 80.0, 5.0)]
    ratios = engine_ratios(rows, [1, 8])
    assert ratios["1"] == pytest.approx({
        "native_plain_over_hf": 4.0, "native_spec_over_native_plain": 0.5, "vllm_plain_over_native_plain": 0.25,
        "vllm_spec_over_native_spec": 0.25, "vllm_spec_over_vllm_plain": 0.5,
        "decode_vllm_plain_over_native_plain": 0.25, "decode_vllm_spec_over_native_spec": 0.25,
        "ttft_vllm_plain_over_native_plain": 2.0, "ttft_vllm_spec_over_native_spec": 0.5})
    assert ratios["8"] == {}


def test_vllm_child_failure_names_its_log(tmp_path, capsys):
    import sys

    from specrl.apps.bench.vllm_engine import _run_child
    from specrl.errors import SpecrlError

    log = tmp_path / "child.log"
    script = "print('vllm noise'); print('bench engine=vllm_plain B=1 tokens=3'); raise SystemExit(3)"
    with pytest.raises(SpecrlError, match="exited with 3; see .*child.log"):
        _run_child([sys.executable, "-c", script], {}, log)
    assert capsys.readouterr().err.endswith("bench engine=vllm_plain B=1 tokens=3\n")  # progress passed on
    assert log.read_text() == "vllm noise\nbench engine=vllm_plain B=1 tokens=3\n"


def test_the_report_says_what_vllms_speculative_rows_ran():
    from specrl.apps.bench.engine import vllm_speculation
    from specrl.apps.bench.vllm_engine import VLLM_SPEC

    settings = Settings.load()
    off = [{"engine": VLLM_SPEC, "batch_size": 1}, {"engine": VLLM_SPEC + DTYPE_SUFFIX["bfloat16"], "batch_size": 8}]
    on = [*off, {"engine": VLLM_SPEC, "batch_size": 8, "tokens_per_step": 1.4}]
    assert vllm_speculation(settings, [{"engine": NATIVE_SPEC, "batch_size": 1, "tokens_per_step": 1.2}]) is None
    assert vllm_speculation(settings, off).startswith("off")  # no steps per token: the server did not draft
    assert "schedule" in vllm_speculation(settings, on) and not vllm_speculation(settings, on).startswith("off")
    assert vllm_speculation(settings.replace(fixed_draft_tokens=4), off) == "EAGLE, fixed k = 4"
