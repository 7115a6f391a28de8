"""The console script, run as a user would (a subprocess)."""

import json
import os
import subprocess
import sys


def _specrl(home, *args):
    env = {**os.environ, "SPECRL_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "specrl.apps.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_generate_prints_text_and_stats(home, tiny_dir):
    proc = _specrl(home, "generate", "Hello", "--model", "tiny-random", "--max-tokens", "8", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["tokens"] == 8 or stats["finish_reason"] == "stop"
    assert stats["target_version"] == "base" and stats["drafter_version"] == "day0"


def test_errors_are_one_line_and_nonzero(home):
    proc = _specrl(home, "fetch-model", "nope")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["specrl: error: unknown model 'nope': use one of smollm2-135m, tiny-random"]
    proc = _specrl(home, "generate", "", "--model", "tiny-random", "--no-chat")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == "specrl: error: the prompt is empty"


def test_a_negative_count_setting_is_a_one_line_error(home):
    proc = _specrl(home, "generate", "hi", "--model", "tiny-random", "--draft-vocab-size", "-3")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["specrl: error: draft_vocab_size must be >= 0, got -3"]


def test_eval_policy_compares_versions_on_the_same_tasks(home, tiny_dir, tmp_path):
    from specrl.weights import WeightsStore

    store = WeightsStore(tmp_path / "store")
    version = store.publish("policy", tiny_dir).version  # the same weights as base: identical greedy answers
    out = tmp_path / "eval.json"
    proc = _specrl(home, "eval-policy", "--env", "arithmetic", "--versions", f"base,{version}", "--tasks", "6",
                   "--max-tokens", "8", "--model", "tiny-random", "--store", str(tmp_path / "store"), "--out", str(out),
                   "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    base, same = report["versions"]["base"], report["versions"][version]
    assert report["tasks"] == 6 and len(base["rewards"]) == 6
    assert all(0.0 <= r <= 1.0 for r in base["rewards"])
    assert base["reward"] == sum(base["rewards"]) / 6
    assert same["rewards"] == base["rewards"] and same["vs_first"] == 0.0
    proc = _specrl(home, "eval-policy", "--env", "arithmetic", "--versions", "base,v9", "--model", "tiny-random",
                   "--store", str(tmp_path / "store"))
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "v9" in proc.stderr
