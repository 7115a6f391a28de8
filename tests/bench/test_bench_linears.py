"""`specrl bench linears`: every int8 candidate computes the same product as the dequantized weight (a call
that computed something else would be timed for nothing), the report and chart, bad flags get one line."""

import json

import pytest
import torch

from specrl.apps.bench.linears import candidates, run_linears_bench
from specrl.apps.cli import main
from specrl.config import Settings
from specrl.models.linear import CALLS, cpu_kernels

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("fmt, library, tolerance", [("int8", "aten._weight_int8pack_mm (torch)", 0.02),
                                                     ("q4", "aten._weight_int4pack_mm_for_cpu (torch)", 0.15)])
def test_every_quantized_candidate_computes_the_product(fmt, library, tolerance):
    """Each within its quantization's error of the float product (per output, per group of 32, 4 bits)."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.02
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    want = x @ w.t()
    found = candidates(fmt)
    assert library in [c.name for c in found]
    assert (f"stream {fmt} (specrl)" in [c.name for c in found]) == (cpu_kernels is not None)
    for c in found:
        got = c.call(x, c.pack(w)).float()
        tolerance = max(tolerance, 0.05) if "dynamic" in c.name else tolerance  # dynamic: activations quantized too
        torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=0, msg=c.name)


@pytest.mark.skipif(cpu_kernels is None, reason="the stream kernel is not built")
def test_bench_linears_report(tmp_path, capsys):
    result = run_linears_bench(Settings.load(threads=1), ["int8"], (1, 2), str(tmp_path))
    report = json.loads((tmp_path / "bench-linears.json").read_text())
    names = [c["name"] for c in report["candidates"]]
    amx = ["stream amx int8 (specrl)"] if CALLS["stream amx"].dtypes else []  # where the CPU has AMX-INT8
    assert names[:3 + len(amx)] == ["stream int8 (specrl)", "stream prefetch int8 (specrl)", *amx,
                                    "aten._weight_int8pack_mm (torch)"]
    for c in report["candidates"]:
        assert len(c["forward_ms"]) == 2 and all(ms > 0 for ms in c["forward_ms"]) and c["gb_s_one_row"] > 0
        assert set(c["per_shape_ms"]) == {"qkv", "o", "gate_up", "down", "head"}
    assert result["rows"] == [1, 2] and report["machine"]["read_gb_s"] > 0
    assert (tmp_path / "bench-linears.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "stream int8 (specrl)" in capsys.readouterr().out


def test_bad_flags_get_one_line(capsys):
    assert main(["bench", "linears", "--rows", "0,1"]) == 1
    assert main(["bench", "linears", "--formats", "int3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specrl: error: --rows takes positive row counts like 1,2,4,8,16; got '0,1'",
                   "specrl: error: --formats takes some of float32, bfloat16, float16, int8, q4; got 'int3'"]
