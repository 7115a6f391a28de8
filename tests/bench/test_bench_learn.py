"""`specrl bench learn` on the tiny model: traffic recorded once and cached, a day-0 drafter trained
on shipped and on recomputed features for a few CPU-seconds each; the report's structure, the
curves, the chart, the cache."""

import json

import pytest

from specrl.apps.bench.learn import FIXED_K, parse_vocabulary, record_traffic, resume_learn_bench, run_learn_bench
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.models.llama import LlamaConfig

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bench_learn_tiny(home, tiny_dir, tmp_path, traffic_cache):
    settings = Settings.load(home=home, model="tiny-random", train_records=2)
    run_learn_bench(settings, minutes=0.04, objectives=["kl"], sources=["shipped", "recomputed"], prompts=4,
                    heldout=2, max_tokens=24, eval_every_s=1.0, out_dir=str(tmp_path))

    report = json.loads((tmp_path / "bench-learn.json").read_text())
    assert (tmp_path / "bench-learn.png").read_bytes()[:8] == PNG_SIGNATURE
    assert report["model"] == "tiny-random" and report["command"] and report["eval_k"] == FIXED_K
    for machine in report["machine"][0].values():  # every number comes with the CPU and its bandwidth
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
    assert report["summary"]["kl/first8192/shipped_over_recomputed_tokens_per_cpu_s"] > 0

    again = record_traffic(settings, tiny_dir, 4, 2, 24)  # the same traffic, from the cache
    assert not again["recorded"] and again["path"] == traffic["path"]
    assert again["train_records"] == traffic["train_records"]


def test_bench_learn_vocabularies_and_resume(home, tiny_dir, tmp_path, traffic_cache):
    """One run per draft vocabulary, each point with its first-token and per-position acceptance; a
    resumed report continues every curve where it stopped (the same drafter, more tokens, more CPU-s)."""
    vocab_size = LlamaConfig.from_dir(tiny_dir).vocab_size
    half = vocab_size // 2
    settings = Settings.load(home=home, model="tiny-random", train_records=2)
    names = [f"first{half}", f"frequent{half}", "all"]
    run_learn_bench(settings, minutes=0.02, objectives=["kl"], sources=["shipped"], prompts=4, heldout=2,
                    max_tokens=24, eval_every_s=0.5, out_dir=str(tmp_path), vocabularies=names)
    first = json.loads((tmp_path / "bench-learn.json").read_text())
    runs = {r["vocabulary"]: r for r in first["runs"]}
    assert set(runs) == set(names)
    assert runs[f"first{half}"]["draft_vocab_size"] == half and runs["all"]["draft_vocab_size"] == vocab_size
    # the most generated ids hold at least as much of what the target generated as any other set of that size
    assert runs[f"frequent{half}"]["vocabulary_share_of_generated"] >= runs[f"first{half}"]["vocabulary_share_of_generated"]
    assert runs["all"]["vocabulary_share_of_generated"] == 1.0
    for run in runs.values():
        for point in run["curve"]:
            rates = point["per_position_acceptance_rate"]
            assert len(rates) == FIXED_K and point["first_token_acceptance"] == rates[0]
            assert all(0 <= b <= a <= 1 for a, b in zip(rates, rates[1:]))

    resume_learn_bench(settings.replace(train_records=5), tmp_path, minutes=0.02, eval_every_s=0.5)
    resumed = json.loads((tmp_path / "bench-learn.json").read_text())
    assert len(resumed["command"]) == 2 and len(resumed["machine"]) == 2 and resumed["minutes"] == pytest.approx(0.04)
    assert resumed["settings"]["train_records"] == 2  # the report's settings, not the command line's
    for before, after in zip(first["runs"], resumed["runs"]):
        assert after["vocabulary"] == before["vocabulary"]
        assert after["curve"][: len(before["curve"])] == before["curve"] and len(after["curve"]) > len(before["curve"])
        last, end = before["curve"][-1], after["curve"][-1]
        assert end["trained_tokens"] > last["trained_tokens"] and end["cpu_s"] >= last["cpu_s"] + 0.02 * 60
        assert end["steps"] > last["steps"]

    for state in tmp_path.glob("state-*.pt"):  # a run whose saved state is gone cannot go on: one clear error
        state.write_bytes(b"truncated")
    with pytest.raises(InvalidRequestError, match="cannot restore the run"):
        resume_learn_bench(settings, tmp_path, minutes=0.02, eval_every_s=0.5)


@pytest.mark.parametrize("name,expected", [("first100", ("first", 100)), ("frequent7", ("frequent", 7)),
                                           ("all", ("all", 1000)), ("first5000", ("all", 1000))])
def test_vocabulary_names(name, expected):
    assert parse_vocabulary(name, 1000) == expected


@pytest.mark.parametrize("name", ["first", "first0", "frequent-3", "top100", ""])
def test_bad_vocabulary_names_are_refused(name):
    with pytest.raises(InvalidRequestError, match="firstN, frequentN"):
        parse_vocabulary(name, 1000)


def test_resume_of_a_directory_without_a_report_is_refused(home, tmp_path):
    with pytest.raises(InvalidRequestError, match="not a bench learn report"):
        resume_learn_bench(Settings.load(home=home, model="tiny-random"), tmp_path, minutes=1, eval_every_s=1)
