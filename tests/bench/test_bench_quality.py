"""`specrl bench quality`: the per-token KL and the greedy prefix against hand-made cases, the bench on the
tiny model (float32 against itself is exact, float16 weights measurably differ), bad formats get one line."""

import json
import math

import matplotlib.image
import pytest
import torch

from specrl.apps.bench.quality import Agreement, common_prefix, parse_formats, run_quality_bench, token_kl
from specrl.apps.cli import main
from specrl.config import Settings
from specrl.errors import InvalidRequestError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_token_kl_is_the_kl_of_the_softmaxes():
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    expected = sum(a * math.log(a / b) for a, b in zip(p.tolist(), q.tolist()))  # 0.5838 nats
    logits_p, logits_q = p.log()[None] + 3.0, q.log()[None] - 1.0  # softmax ignores a shift
    assert token_kl(logits_p, logits_q).item() == pytest.approx(expected, rel=1e-6)  # float32 logits
    assert token_kl(logits_q, logits_p).item() != pytest.approx(expected, rel=1e-3)  # not symmetric
    assert token_kl(logits_p, logits_p).item() == 0.0


def test_agreement_counts_top1_over_positions():
    reference = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    other = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.0, 0.0]])  # same argmax at row 0 only
    agreement = Agreement()
    agreement.add(reference, other)
    summary = agreement.summary()
    assert summary["tokens"] == 2 and summary["top1"] == 0.5
    assert summary["kl_mean"] == pytest.approx(token_kl(reference, other).mean().item())


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2]) == 2 and common_prefix([], [1]) == 0 and common_prefix([9], [1]) == 0


def test_bench_quality_tiny(tmp_path, tiny_dir, capsys):
    settings = Settings.load(model="tiny-random", threads=1)
    result = run_quality_bench(settings, ["float32", "float16"], prompts=3, max_tokens=6, env_name="format",
                               env_tasks=2, out_dir=str(tmp_path))
    report = json.loads((tmp_path / "bench-quality.json").read_text())
    assert report["formats"] == json.loads(json.dumps(result["formats"]))
    same, half = report["formats"]["float32"], report["formats"]["float16"]
    # float32 against itself: the same packed weights, the same text -> exactly the same distributions
    assert same["kl_mean"] == 0.0 and same["top1"] == 1.0 and same["identical_answers"] == 1.0
    assert same["greedy_prefix_mean"] == same["answer_tokens_mean"] and same["reward_vs_float32"] == 0.0
    # float16 weights round every weight: the distributions move a little, not a lot
    assert 0.0 < half["kl_mean"] < 1e-3 and half["tokens"] == same["tokens"] > 0
    assert 0.0 <= half["top1"] <= 1.0 and len(half["greedy_prefix"]) == 3
    assert report["prompts"] == 3 and report["env_tasks"] == 2 and report["machine"]["read_gb_s"] > 0
    png = tmp_path / "bench-quality.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and min(matplotlib.image.imread(png).shape[:2]) > 100
    out = capsys.readouterr().out
    assert "KL mean" in out and "float16" in out and str(tmp_path / "bench-quality.json") in out


def test_unknown_formats_are_one_line_errors(capsys):
    with pytest.raises(InvalidRequestError, match="--dtypes takes some of float32, float16, bfloat16, int8, q4"):
        parse_formats("float16,int3")
    assert main(["bench", "quality", "--dtypes", ""]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "specrl: error: --dtypes takes some of float32, float16, bfloat16, int8, q4; got ''"]
