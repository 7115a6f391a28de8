"""`specrl bench learn` on the tiny model: traffic recorded once and cached, a day-0 drafter trained
on shipped and on recomputed features for a few CPU-seconds each; the report's structure, the
curves, the chart, the cache."""

import json
import shutil

import pytest

from specrl.apps.bench.learn import FIXED_K, record_traffic, run_learn_bench
from specrl.config import Settings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def cache(home):
    """The traffic caches this test records under <home>/bench-learn, removed afterwards."""
    root = home / "bench-learn"
    before = set(root.iterdir()) if root.is_dir() else set()
    yield root
    for path in (set(root.iterdir()) if root.is_dir() else set()) - before:
        shutil.rmtree(path, ignore_errors=True)


def test_bench_learn_tiny(home, tiny_dir, tmp_path, cache):
    settings = Settings.load(home=home, model="tiny-random", train_records=2)
    run_learn_bench(settings, minutes=0.04, objectives=["kl"], sources=["shipped", "recomputed"], prompts=4,
                    heldout=2, max_tokens=24, eval_every_s=1.0, out_dir=str(tmp_path))

    report = json.loads((tmp_path / "bench-learn.json").read_text())
    assert (tmp_path / "bench-learn.png").read_bytes()[:8] == PNG_SIGNATURE
    assert report["model"] == "tiny-random" and report["command"] and report["eval_k"] == FIXED_K
    for machine in report["machine"].values():  # every number comes with the CPU and its bandwidth
        assert machine["read_gb_s"] > 0 and machine["model"] and isinstance(machine["flags"], list)
    traffic = report["traffic"]
    assert traffic["recorded"] and traffic["train_records"] > 0 and traffic["feature_bytes_per_token"] > 0
    runs = {r["source"]: r for r in report["runs"]}
    assert set(runs) == {"shipped", "recomputed"} and {r["objective"] for r in report["runs"]} == {"kl"}
    for run in runs.values():
        first, last = run["curve"][0], run["curve"][-1]
        assert first["trained_tokens"] == 0 and first["cpu_s"] == 0
        assert last["trained_tokens"] > 0 and last["cpu_s"] >= 0.04 * 60 and run["steps"] > 0
        assert all(1.0 <= p["acceptance_length"] <= FIXED_K + 1 for p in run["curve"])
    assert not runs["shipped"]["full_target_loaded"] and runs["shipped"]["trainer_recomputed_tokens"] == 0
    assert runs["recomputed"]["full_target_loaded"] and runs["recomputed"]["trainer_recomputed_tokens"] > 0
    assert report["summary"]["kl/shipped_over_recomputed_tokens_per_cpu_s"] > 0

    again = record_traffic(settings, tiny_dir, 4, 2, 24)  # the same traffic, from the cache
    assert not again["recorded"] and again["path"] == traffic["path"]
    assert again["train_records"] == traffic["train_records"]
