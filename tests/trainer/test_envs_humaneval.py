"""HumanEval: the package's data, the held-out split, the load-time check of every canonical solution,
and the scorer on hand-written right, wrong and hostile answers, run for real in the sandbox."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from specrl.trainer.envs import make_env
from specrl.trainer.envs import humaneval
from specrl.trainer.envs.humaneval import (HELDOUT_PROBLEMS, INSTRUCTION, HumanEvalEnv, extract_solution,
                                           load_problems, make_task)
from specrl.trainer.envs.sandbox import Limits

FAST = Limits(wall_s=3.0, cpu_s=3)
PROBLEMS = {p["task_id"]: p for p in load_problems()[0]}


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """The real dataset, every canonical solution run once against its tests (a few seconds)."""
    env = make_env("humaneval", cache_dir=tmp_path_factory.mktemp("cache"))
    env.problems("train")
    return env


def _task(problem_id: str):
    return make_task(PROBLEMS[problem_id], "train")


def _score(problem_id: str, completion: str, limits: Limits = FAST):
    return HumanEvalEnv(limits).score(_task(problem_id), completion)


# ---- data and splits -----------------------------------------------------------------------------------

def test_the_package_data_and_a_fixed_heldout_split(verified):
    problems, sha = load_problems()
    assert len(problems) == 164 and len(sha) == 64 and len(PROBLEMS) == 164
    # every canonical solution passes in the sandbox here (a drop would be logged with its reason)
    assert len(verified.problems("train")) + len(verified.problems("heldout")) + len(verified.dropped) == 164
    assert len(verified.dropped) <= 4, verified.dropped
    train = {p["task_id"] for p in verified.problems("train")}
    held = {p["task_id"] for p in verified.problems("heldout")}
    assert not train & held
    # the rule: the 40 task ids whose sha1 sorts first, whatever the seed
    first = sorted(PROBLEMS, key=lambda i: humaneval._sha1(i))[:HELDOUT_PROBLEMS]
    assert held == set(first) - set(verified.dropped)


def test_tasks_are_seeded_each_problem_once_per_pass(verified):
    held = list(itertools.islice(verified.tasks("heldout", 0), 2 * len(verified.problems("heldout"))))
    n = len(verified.problems("heldout"))
    assert len({t.id for t in held[:n]}) == n and {t.id for t in held[n:]} == {t.id for t in held[:n]}
    assert held == list(itertools.islice(verified.tasks("heldout", 0), 2 * n))
    assert held[:n] != list(itertools.islice(verified.tasks("heldout", 1), n))
    task = held[0]
    assert task.split == "heldout" and task.prompt.startswith(INSTRUCTION + "\n\n```python\n")
    assert PROBLEMS[task.data["task_id"]]["prompt"].strip("\n") in task.prompt and task.prompt.endswith("\n```")
    assert "canonical_solution" not in task.data and task.messages == [{"role": "user", "content": task.prompt}]


def test_the_check_is_cached_and_not_run_again(verified, tmp_path, monkeypatch):
    cache_dir = verified.cache_dir
    [cached] = list(cache_dir.glob("humaneval-verified-*.json"))
    assert json.loads(cached.read_text())["dropped"] == verified.dropped
    humaneval._VERIFIED.clear()                # a new process: only the file is left

    def no_sandbox(*args, **kwargs):
        raise AssertionError("the sandbox ran although the check was cached")

    monkeypatch.setattr(humaneval, "run_python", no_sandbox)
    again = HumanEvalEnv(cache_dir=cache_dir)
    assert again.problems("heldout") == verified.problems("heldout") and again.dropped == verified.dropped


def test_problems_whose_own_tests_cannot_pass_are_dropped_and_logged(tmp_path, caplog):
    good = PROBLEMS["HumanEval/0"]
    broken = [{**good, "task_id": "Broken/syntax", "test": "def check(candidate):\n    assert candidate(\n"},
              {**good, "task_id": "Broken/import", "test": "import numpy_not_here\n" + good["test"]},
              {**good, "task_id": "Broken/solution", "canonical_solution": "    return None\n"},
              {**good, "task_id": "Broken/timeout", "canonical_solution": "    while True:\n        pass\n"}]
    limits_before = humaneval.VERIFY_LIMITS
    humaneval.VERIFY_LIMITS = Limits(wall_s=3.0, cpu_s=10)   # the loop hits the wall clock first; the good one
                                                           # has room to start on a loaded 2-core machine
    try:
        with caplog.at_level(logging.WARNING, logger="specrl.trainer.envs"):
            env = HumanEvalEnv(FAST, cache_dir=tmp_path, problems=[good, *broken], heldout_problems=1)
            kept = env.problems("train") + env.problems("heldout")
    finally:
        humaneval.VERIFY_LIMITS = limits_before
    assert [p["task_id"] for p in kept] == ["HumanEval/0"]
    assert set(env.dropped) == {p["task_id"] for p in broken}
    assert "SyntaxError" in env.dropped["Broken/syntax"] and "numpy_not_here" in env.dropped["Broken/import"]
    assert "canonical solution fails" in env.dropped["Broken/solution"]
    assert env.dropped["Broken/timeout"].startswith("timeout")
    logged = [r.message for r in caplog.records if "humaneval_dropped" in r.message]
    assert len(logged) == 4 and all(any(p["task_id"] in m for m in logged) for p in broken)
    assert not list(tmp_path.glob("*.json"))   # not cached: a timeout may be the machine, tried again next time


# ---- extraction ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, form, starts", [
    ("Here:\n```python\ndef f(x):\n    return 1\n```\nand\n```python\ndef f(x):\n    return 2\n```", "function",
     "def f(x):\n    return 2"),
    ("```py\nimport math\n\ndef f(x):\n    return math.pi\n```", "function", "import math"),
    ("Sure! The function:\n\ndef f(x):\n    return x\n\nIt returns x.", "function", "def f(x):"),
    ("    return x + 1\n", "body", "    return x + 1"),
    ("return x + 1", "body", "    return x + 1"),
    ("```python\nresult = x * 2\nreturn result\n```", "body", "    result = x * 2\n    return result"),
    ("```python\ndef helper(y):\n    return y\n```", "body", "    def helper(y):"),
])
def test_extract_solution(completion, form, starts):
    code, found = extract_solution(completion, "f")
    assert found == form and code.startswith(starts), code


# ---- scoring, for real in the sandbox -------------------------------------------------------------------

RIGHT_0 = ("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
           "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])")


def test_right_answers_pass_in_every_form():
    fenced = _score("HumanEval/0", f"Here is the function:\n```python\n{RIGHT_0}\n```\nIt compares every pair.")
    assert fenced.reward == 1.0 and fenced.error is None and fenced.details["form"] == "function"
    assert fenced.details["passed"] is True
    raw = _score("HumanEval/0", RIGHT_0 + "\n\nThis compares every pair of numbers once.")  # unfenced, prose after
    assert raw.reward == 1.0 and raw.details["form"] == "function"
    body = _score("HumanEval/0", "    for i, a in enumerate(numbers):\n        for b in numbers[i + 1:]:\n"
                                 "            if abs(a - b) < threshold:\n                return True\n"
                                 "    return False\n")
    assert body.reward == 1.0 and body.details["form"] == "body"
    canonical = PROBLEMS["HumanEval/38"]          # decode_cyclic: the prompt's helper encode_cyclic is there
    uses_helper = _score("HumanEval/38", "```python\ndef decode_cyclic(s: str):\n"
                                         "    return encode_cyclic(encode_cyclic(s))\n```")
    assert uses_helper.reward == 1.0, (uses_helper, canonical["canonical_solution"])


def test_wrong_answers_fail_with_the_failing_assert():
    wrong = _score("HumanEval/0", "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```")
    assert wrong.reward == 0.0 and wrong.error is None and wrong.details["passed"] is False
    assert "AssertionError" in wrong.details["failure"] and wrong.details["test_line"].startswith("assert candidate(")
    crash = _score("HumanEval/0", "```python\ndef has_close_elements(numbers, threshold):\n    return 1 / 0\n```")
    assert crash.reward == 0.0 and "ZeroDivisionError" in crash.details["failure"]
    stub = _score("HumanEval/0", "I am not sure how to do this.")
    assert stub.reward == 0.0 and "load failed" in stub.error
    assert "no code" in _score("HumanEval/0", "   \n").error
    other = _score("HumanEval/0", "```python\ndef close(numbers, threshold):\n    return True\n```")
    assert other.reward == 0.0                  # a body that defines something else: the stub returns None


def test_code_that_cannot_load_scores_0_with_the_reason():
    syntax = _score("HumanEval/0", "```python\ndef has_close_elements(numbers, threshold) return True\n```")
    assert syntax.reward == 0.0 and "SyntaxError" in syntax.error
    raises = _score("HumanEval/0", "```python\nimport not_a_module_here\ndef has_close_elements(n, t):\n"
                                   "    return 1\n```")
    assert raises.reward == 0.0 and "ModuleNotFoundError" in raises.error


def test_hostile_answers_cannot_pass():
    loop = _score("HumanEval/0", "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n"
                                 "        pass\n```", Limits(wall_s=1.0, cpu_s=2))
    assert loop.reward == 0.0 and "timeout" in loop.error
    for code in ("import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)",
                 "import sys\ndef has_close_elements(numbers, threshold):\n    sys.exit(0)",
                 "import os, sys\ndef has_close_elements(n, t):\n    return 1\nfd = int(sys.argv[1])\n"
                 "os.write(fd, b'{\"stage\": \"passed\"}\\n{\"nonce\": \"0\", \"stage\": \"passed\"}\\n')\n"
                 "os._exit(0)",
                 "print('passed')\nraise SystemExit(0)"):
        score = _score("HumanEval/0", f"```python\n{code}\n```")
        assert score.reward == 0.0, (code, score)
    memory = _score("HumanEval/0", "```python\nx = ' ' * 10**10\ndef has_close_elements(n, t):\n    return 1\n```")
    assert memory.reward == 0.0 and "MemoryError" in memory.error
