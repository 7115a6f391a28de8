"""`specrl bench kernels` on tiny shapes (CPU: twins and references only): report structure."""

from __future__ import annotations

import json

import pytest
import torch

from specrl.apps.bench.kernels import run_kernel_bench
from specrl.config import Settings
from specrl.models.linear import cpu_kernels

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bench_kernels_writes_json_png_and_table(tmp_path, capsys):
    result = run_kernel_bench(Settings.load(), quick=True, out_dir=str(tmp_path), verify_shapes=[(4, 2, 256)],
                              loss_shapes=[(64, 32, 512), (2 ** 20, 4096, 131072)], draw_shapes=[(8, 3000)])
    report = json.loads((tmp_path / "bench-kernels.json").read_text())
    assert report == json.loads(json.dumps(result))
    assert report["command"] and report["torch"] == torch.__version__ and report["quick"] is True
    (verify,) = report["verify"]
    assert (verify["B"], verify["K"], verify["V"]) == (4, 2, 256)
    assert verify["rowwise_over_twin"] == pytest.approx(verify["rowwise_ms"] / verify["twin_ms"])
    assert verify["checks_ms"] > 0 and 0 <= verify["accepted_mean"] <= 2
    small, huge = report["loss"]
    assert small["twin_ms"] > 0 and small["reference_ms"] > 0
    assert small["twin_peak_bytes"] >= 0 and small["reference_peak_bytes"] >= 0
    # the twin and the materialised reference agree (on a GPU the bench runs them in bfloat16 with TF32)
    assert small["reference_max_rel_diff"] < (1e-2 if torch.cuda.is_available() else 1e-4)
    if not torch.cuda.is_available():
        assert "triton_ms" not in small and report["triton_used"] is False
        assert "GiB" in huge["twin_skipped"] and "GiB" in huge["reference_skipped"]  # over the CPU RAM budget
        assert any("docs/results/2026-12-04-h200-triton-kernels.md" in note for note in report["notes"])
    (draw,) = report["draw"]
    assert (draw["B"], draw["V"]) == (8, 3000) and draw["twin_ms"] > 0
    if cpu_kernels is not None:  # the C draw beside torch's, the same tokens but at float rounding
        assert draw["c_ms"] > 0 and draw["twin_over_c"] == pytest.approx(draw["twin_ms"] / draw["c_ms"])
        assert draw["tokens_equal"] >= 7 / 8
    assert (tmp_path / "bench-kernels.png").read_bytes().startswith(PNG_SIGNATURE)
    out = capsys.readouterr().out
    assert "twin/C" in out and "loop/twin" in out and "twin skipped" in out and str(tmp_path / "bench-kernels.json") in out


def test_the_loss_is_measured_at_the_trainers_own_shapes(home, tiny_dir, tmp_path):
    from specrl.apps.bench.kernels import trainer_loss_shapes
    from specrl.models.llama import LlamaConfig

    cfg = LlamaConfig.from_dir(tiny_dir)
    settings = Settings.load(home=home, model="tiny-random", train_positions=256, train_records=8, draft_vocab_size=64)
    assert trainer_loss_shapes(settings) == [(32, cfg.hidden_size, 64), (256, cfg.hidden_size, 64),
                                             (256, cfg.hidden_size, cfg.vocab_size)]
    assert trainer_loss_shapes(settings.replace(draft_vocab_size=0))[0] == (32, cfg.hidden_size, cfg.vocab_size)
    assert trainer_loss_shapes(settings.replace(model=str(tmp_path / "no-model"))) == []
