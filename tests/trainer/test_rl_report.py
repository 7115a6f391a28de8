"""Acceptance recovery after policy swaps, on hand-built /metrics counter sequences."""

import pytest

from specrl.apps.rl_report import (acceptance_recovery, final_eval_lines, final_eval_rows, pipeline_lines,
                                   recovery_summary, summary_lines, write_report)


def _samples(*intervals, first: str = "v0"):
    """Cumulative counter samples, one a second, from (policy, steps, accepted[, eval]) per interval;
    each verify step emits its accepted drafts plus one token. The first sample is on `first`."""
    samples = [{"t": 0.0, "policy": first, "tokens": 0.0, "steps": 0.0, "accepted": 0.0}]
    for i, (policy, steps, accepted, *evaluation) in enumerate(intervals, 1):
        last = samples[-1]
        samples.append({"t": float(i), "policy": policy, "tokens": last["tokens"] + steps + accepted,
                        "steps": last["steps"] + steps, "accepted": last["accepted"] + accepted,
                        "eval": bool(evaluation and evaluation[0])})
    return samples


BEFORE = [("v0", 50, 50)] * 4  # 100 tokens each at acceptance length 2.0
SWAP = ("v1", 5, 0)  # the interval in which the policy changed: counted on neither side


def test_recovers_when_a_window_of_tokens_is_back_within_ten_percent():
    samples = _samples(*BEFORE, SWAP, ("v1", 100, 20), ("v1", 80, 40), ("v1", 60, 60), ("v1", 60, 60))
    [swap] = acceptance_recovery(samples, window_tokens=200)
    assert (swap["from"], swap["to"], swap["t"]) == ("v0", "v1", 5.0)
    assert swap["pre"] == pytest.approx(2.0)
    assert swap["after"] == pytest.approx(240 / 180)  # the first 240 tokens after the swap interval
    # windows of >= 200 tokens: 1.33, 1.71 (240/140), then 2.0 >= 0.9 * 2.0 after 4 x 120 tokens
    assert swap["recovered"] is True and swap["tokens_to_recover"] == 480
    assert swap["t_recovered"] == 9.0 and swap["recovered_value"] == pytest.approx(2.0)
    assert swap["tokens_seen"] == 480


def test_not_recovered_before_the_next_swap_and_the_next_swap_measured_on_its_own():
    samples = _samples(*BEFORE, SWAP, ("v1", 100, 20), ("v1", 100, 20), ("v2", 5, 0), ("v2", 50, 50))
    first, second = acceptance_recovery(samples, window_tokens=200)
    assert first["recovered"] is False and first["tokens_to_recover"] is None
    assert first["tokens_seen"] == 240 and first["after"] == pytest.approx(1.2)
    assert second["pre"] == pytest.approx(1.2) and second["recovered"] is False  # 100 tokens: no full window
    summary = recovery_summary([first, second], window_tokens=200)
    assert (summary["recovered"], summary["not_recovered"], summary["max_tokens_to_recover"]) == (0, 2, None)


def test_no_swaps_no_entries():
    assert acceptance_recovery(_samples(*BEFORE), window_tokens=200) == []
    assert acceptance_recovery(_samples(("v0", 1, 0)), window_tokens=1) == []
    assert recovery_summary([], window_tokens=200)["swaps"] == []


def test_evaluation_intervals_and_counter_resets_are_left_out():
    samples = _samples(*BEFORE, SWAP, ("v1", 100, 20), ("v1", 10, 290, True), ("v1", 100, 20),
                       ("v1", 60, 60), ("v1", 60, 60))
    samples[-1] = {**samples[-1], "tokens": 0.0, "steps": 0.0, "accepted": 0.0}  # the server restarted
    [swap] = acceptance_recovery(samples, window_tokens=200)
    assert swap["after"] == pytest.approx(1.2)  # the greedy evaluation's 3.0 is not a rollout window
    assert swap["recovered"] is False and swap["tokens_seen"] == 360


def test_unknown_when_nothing_was_measured_before_the_swap():
    [swap] = acceptance_recovery(_samples(SWAP, ("v1", 50, 50)), window_tokens=50)
    assert swap["pre"] is None and swap["recovered"] is None and swap["after"] == pytest.approx(2.0)
    assert recovery_summary([swap], window_tokens=50)["unknown"] == 1


def test_report_files_and_summary(tmp_path, capsys):
    samples = _samples(*BEFORE, SWAP, ("v1", 100, 20), ("v1", 60, 60), ("v1", 60, 60))
    swaps = acceptance_recovery(samples, window_tokens=100)
    speed = {"with_speculation": {"tokens_per_s": 150.0}, "without_speculation": {"tokens_per_s": 100.0},
             "ratio": 1.5, "ratio_median": 1.4, "tasks": 8, "samples_per_task": 4, "rounds": 2, "policy": "v1"}
    report = {"env": "arithmetic", "evals": [{"policy": "base", "reward": 0.5, "ci95": 0.1}], "samples": samples,
              "recovery": recovery_summary(swaps, window_tokens=100), "speed": speed, "pipeline": PIPELINE}
    write_report(tmp_path, report)
    assert (tmp_path / "rl-report.png").read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err
    assert "recovered after 240 tokens" in err and "1.50x" in err and "median over rounds 1.40x" in err
    assert "rl-report.json" in err
    assert "environment" in err and "2.40/s" in err
    assert "not measured" in summary_lines({**report, "speed": {"error": "OSError()"}, "pipeline": None})[-1]
    assert not any("decode steps" in line for line in summary_lines(report))  # a report from before the split
    split = {**speed, "with_speculation": {"tokens_per_s": 150.0, "tokens": 300, "seconds": 2.0, "decode_seconds": 1.5},
             "without_speculation": {"tokens_per_s": 100.0, "tokens": 200, "seconds": 2.0, "decode_seconds": 1.0}}
    [line] = [line for line in summary_lines({**report, "speed": split}) if "decode steps" in line]
    assert "5.00 ms/token with (75% of request time)" in line and "5.00 ms/token without (50%" in line
    write_report(tmp_path, {**report, "pipeline": None})       # a report from before the pipeline: no panel
    assert (tmp_path / "rl-report.png").read_bytes()[:4] == b"\x89PNG"
    write_report(tmp_path, {**report, "final_eval": FINAL})
    assert (tmp_path / "rl-report.png").read_bytes()[:4] == b"\x89PNG"
    assert "instruction_strict   0.291 -> 0.359  +0.068 [+0.034, +0.102]  p=0.0001" in capsys.readouterr().err


FINAL = {"policy": "v20", "tasks": 256, "report": "final-eval.json",
         "reward": {"base": 0.287, "trained": 0.353, "diff": 0.066, "ci95": 0.041},
         "instruction_strict": {"base": 0.291, "trained": 0.359, "diff": 0.068, "ci95": [0.034, 0.102],
                                "p_value": 0.0001}}


def test_final_evaluation_rows_read_both_kinds_of_interval():
    (reward, _, reward_ci), (strict, entry, strict_ci) = final_eval_rows(FINAL)
    assert (reward, strict) == ("reward", "instruction_strict") and entry["p_value"] == 0.0001
    assert reward_ci == pytest.approx((0.025, 0.107)) and strict_ci == (0.034, 0.102)
    assert final_eval_lines({"skipped": "no policy was published"}) == [
        "final evaluation skipped: no policy was published"]
    assert final_eval_lines(None) == []


PIPELINE = {"seconds": 100.0, "stages": {
    "generator": {"rollouts": 240, "rollouts_per_s": 2.4, "busy_s": 90.0, "paused_s": 5.0,
                  "waited_s": {"environment": 3.5, "trainer": 1.0}},
    "environment": {"scores": 240, "scores_per_s": 2.4, "workers": 4, "busy_s": 20.0,
                    "waited_s": {"generator": 79.0}, "timeouts": 2, "deaths": 0, "faults": 2, "restarts": 2},
    "trainer": {"samples": 224, "samples_per_s": 2.24, "busy_s": 30.0, "waited_s": {"environment": 70.0}}}}


def test_pipeline_lines_put_the_stages_side_by_side():
    header, generator, environment, trainer = pipeline_lines(PIPELINE)
    assert "100 s" in header
    assert generator.split()[:4] == ["generator", "240", "rollouts", "2.40/s"]
    assert "3.5 s for the environment, 1.0 s for the trainer" in generator
    assert "79.0 s for the generator" in environment and "4 workers, 2 timeouts" in environment
    assert trainer.split()[:4] == ["trainer", "224", "samples", "2.24/s"] and "70.0 s for the environment" in trainer
    assert pipeline_lines(None) == []
