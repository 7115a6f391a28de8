"""The console script, run as a user would (a subprocess)."""

import json
import os
import subprocess
import sys


def _specrl(home, *args):
    env = {**os.environ, "SPECRL_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "specrl.cli", *args], capture_output=True, text=True, env=env,
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
