"""`specrl eval-policy` with pass@k on the tiny model: a user environment that random text solves about
half the time, two versions with the same weights (so the same greedy answers), each answered by a live server of
its own, and its flags' checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrl.apps.cli import main
from specrl.apps.eval_policy import evaluate_policies
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.trainer.rollout import pass_at_k
from specrl.weights import WeightsStore

HERE = Path(__file__).parent


def test_pass_at_k_per_version_and_paired(home, tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(HERE))
    store = WeightsStore(tmp_path / "store")
    version = store.publish("policy", tiny_dir).version          # the same weights as base
    settings = Settings.load(home=home, model="tiny-random", store=str(tmp_path / "store"), threads=1)
    result = evaluate_policies(settings, "user_envs:EvenLength", ["base", version], tasks=8, max_tokens=6,
                               out=tmp_path / "eval.json", samples=5, k=2, temperature=1.0, score_workers=2)
    assert result["tasks"] == 3 and result["samples"] == 5 and result["k"] == 2   # the split has 3 tasks
    base, same = result["versions"]["base"], result["versions"][version]
    assert len(base["correct"]) == 3 and all(0 <= c <= 5 for c in base["correct"])
    assert base["pass@2"]["per_task"] == [pass_at_k(5, c, 2) for c in base["correct"]]
    assert base["pass@2"]["value"] == pytest.approx(sum(base["pass@2"]["per_task"]) / 3)
    assert base["pass@1_greedy"]["per_task"] == base["rewards"] and set(base["rewards"]) <= {0.0, 1.0}
    # the same weights, each version through its own live server with speculation on: the same greedy answers
    # (speculation is lossless), a paired difference of exactly 0; sampled answers only follow the same distribution
    assert same["rewards"] == base["rewards"] and same["vs_first"] == 0.0
    assert all(0 <= c <= 5 for c in same["correct"])
    for version in ("base", version):
        served = result["served"][version]
        assert served["completion_tokens"] > 0 and served["spec_decode"]["num_steps"] > 0
    out = capsys.readouterr().out
    assert "pass@2 (n=5, T=1)" in out and f"{version} - base" in out and (tmp_path / "eval.json").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--samples", "3", "--k", "5"], "1 <= --k <= --samples"),
    (["--samples", "3", "--k", "2", "--temperature", "0"], "--temperature in (0, 2]"),
    (["--env", "user_envs:Nope"], "module user_envs has no class 'Nope'"),
])
def test_bad_flags_are_one_line_errors(home, tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.syspath_prepend(str(HERE))
    code = main(["eval-policy", "--versions", "base", "--model", "tiny-random", "--home", str(home),
                 "--store", str(tmp_path / "store"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0]


def test_pass_at_k_needs_samples_at_least_k(home):
    with pytest.raises(InvalidRequestError, match="--k <= --samples"):
        evaluate_policies(Settings.load(home=home, model="tiny-random"), "arithmetic", ["base"], 4, samples=2, k=3)
