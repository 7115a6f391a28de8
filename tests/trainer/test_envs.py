"""Environments: scorers on hand-written right, wrong and hostile answers; the sandbox's limits;
checked_score on failing scorers; seeded, disjoint task splits. (HumanEval: test_envs_humaneval.py;
user environments and the scoring pool: test_envs_user.py.)"""

from __future__ import annotations

import itertools
import math
import os
import socket
import time
from fractions import Fraction

import pytest

from specrl.errors import InvalidRequestError
from specrl.trainer.envs import ENVIRONMENTS, Environment, Score, Task, checked_score, make_env
from specrl.trainer.envs.arithmetic import ArithmeticEnv, extract_answer, plain_split
from specrl.trainer.envs.code import TEMPLATES, CodeEnv, extract_code
from specrl.trainer.envs.format import CONSTRAINTS, FormatEnv, instruction
from specrl.trainer.envs.sandbox import Limits, isolation, run_python

FAST = Limits(wall_s=1.0, cpu_s=2)


def _code_task(function: str, calls: list, expected: list) -> Task:
    return Task(f"code-test-{function}", f"Write `{function}`.", "train",
                {"function": function, "calls": calls, "expected": expected, "template": "test"})


def _fenced(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\nHope this helps."


# ---- the interface -------------------------------------------------------------------------------------

def test_make_env_names_and_protocol():
    for name in ENVIRONMENTS:
        env = make_env(name)
        assert env.name == name and isinstance(env, Environment)
    with pytest.raises(InvalidRequestError, match="arithmetic, code, format, humaneval, ifeval, or package.module:Class"):
        make_env("chess")
    with pytest.raises(ValueError, match="train, heldout"):
        next(make_env("arithmetic").tasks("test", 0))


@pytest.mark.parametrize("name", [n for n in ENVIRONMENTS if n != "humaneval"])   # humaneval: its own file
def test_tasks_are_seeded_and_splits_disjoint(name):
    env = make_env(name)
    first = list(itertools.islice(env.tasks("train", 0), 200))
    assert first == list(itertools.islice(env.tasks("train", 0), 200))
    assert first != list(itertools.islice(env.tasks("train", 1), 200))
    heldout = list(itertools.islice(env.tasks("heldout", 0), 200))
    assert {t.split for t in first} == {"train"} and {t.split for t in heldout} == {"heldout"}
    assert not {t.prompt for t in first} & {t.prompt for t in heldout}
    assert all(t.messages == [{"role": "user", "content": t.prompt}] for t in first[:5])


def test_heldout_code_templates_and_plain_expressions_never_train():
    train = {t.data["template"] for t in itertools.islice(CodeEnv().tasks("train", 0), 400)}
    held = {t.data["template"] for t in itertools.islice(CodeEnv().tasks("heldout", 0), 100)}
    assert held and not train & held and len(TEMPLATES) >= 20 and len(train | held) == len(TEMPLATES)
    expressions = {split: {t.data["expression"] for t in itertools.islice(ArithmeticEnv().tasks(split, 3), 400)
                           if "expression" in t.data} for split in ("train", "heldout")}
    assert expressions["heldout"] and not expressions["train"] & expressions["heldout"]
    assert all(plain_split(e) == split for split, group in expressions.items() for e in group)


# ---- checked_score (in the scoring worker; timeouts and crashes: the pool, test_envs_user.py) ----------

class _Broken:
    name = "broken"

    def __init__(self, behaviour):
        self.behaviour = behaviour

    def tasks(self, split, seed):
        yield Task("broken-1", "?", split)

    def score(self, task, completion):
        return self.behaviour()


def test_checked_score_turns_a_raising_scorer_into_reward_0():
    def boom():
        raise KeyError("answer")

    score, fault = checked_score(_Broken(boom), Task("t", "?", "train"), "42")
    assert score.reward == 0.0 and "KeyError" in score.error and fault == score.error


@pytest.mark.parametrize("bad", [Score(math.nan), Score(1.5), Score(-0.1), Score("1"), 1.5, -0.5, math.inf, None,
                                 "1.0", True, [1.0]])
def test_checked_score_refuses_invalid_scores(bad):
    score, fault = checked_score(_Broken(lambda: bad), Task("t", "?", "train"), "42")
    assert score.reward == 0.0 and "invalid" in score.error and fault


@pytest.mark.parametrize("good, reward", [(1, 1.0), (0.25, 0.25), (Fraction(1, 2), 0.5), (Score(0.75), 0.75)])
def test_checked_score_takes_numbers_and_scores(good, reward):
    score, fault = checked_score(_Broken(lambda: good), Task("t", "?", "train"), "42")
    assert (score.reward, score.error, fault) == (reward, None, None) and type(score.reward) is float


def test_checked_score_passes_a_good_score_through():
    task = Task("a", "?", "train", {"answer": "42"})
    assert checked_score(ArithmeticEnv(), task, "Answer: 42") == (ArithmeticEnv().score(task, "Answer: 42"), None)


# ---- arithmetic ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, value, method", [
    ("6 * 7 = 42\nAnswer: 42", 42, "answer"),
    ("The answer is 1,234.", 1234, "answer"),
    ("So it costs $12.50.", Fraction(25, 2), "last"),
    ("Going down 8 steps from 3 gives x = -5", -5, "last"),
    ("10-5=5", 5, "last"),
    ("Answer: \u22123", -3, "answer"),
    ("First 3, then 4, so 7 in total. Final answer: 7.", 7, "answer"),
    ("Answer: 7\nHope that answers it, I checked 8 and 9 too.", 7, "answer"),
    ("We get \\boxed{3/4} which is 0.75", Fraction(3, 4), "boxed"),
    ("\\boxed{\\frac{1}{2}}", Fraction(1, 2), "boxed"),
    ("Answer: 0.125", Fraction(1, 8), "answer"),
    ("I don't know.", None, None),
])
def test_extract_answer(completion, value, method):
    assert extract_answer(completion) == (None if value is None else Fraction(value), method)


def test_arithmetic_scores_right_wrong_unparseable_and_multiple_numbers():
    env = ArithmeticEnv()
    task = Task("a", "What is 7 * 8? ...", "train", {"answer": "56"})
    assert env.score(task, "7 * 8 = 56\nAnswer: 56").reward == 1.0
    assert env.score(task, "Answer: 54").reward == 0.0
    wrong = env.score(task, "I think it is 7 times 8, which is 15.")       # the last number decides
    assert wrong.reward == 0.0 and wrong.details["extracted"] == "15" and wrong.error is None
    nothing = env.score(task, "seven eights are fifty-six")
    assert nothing.reward == 0.0 and "no number" in nothing.error
    decimal = Task("b", "?", "train", {"answer": "12.5"})
    assert env.score(decimal, "Answer: $12.50").reward == 1.0
    assert env.score(decimal, "Answer: 12.5000001").reward == 1.0            # within 1e-6
    assert env.score(decimal, "Answer: 12.51").reward == 0.0


def test_arithmetic_tasks_carry_their_own_answers():
    env = ArithmeticEnv(word_fraction=0.3)
    tasks = list(itertools.islice(env.tasks("train", 0), 300))
    assert {t.data["kind"].split(":")[0] for t in tasks} == {"plain", "word"}
    for t in tasks:
        assert t.prompt.endswith("'Answer: <number>'.")
        assert env.score(t, f"Answer: {t.data['answer']}").reward == 1.0


# ---- code: extraction and honest answers ---------------------------------------------------------------

def test_extract_code_prefers_the_block_defining_the_function():
    two = "```python\ndef add(a, b):\n    return a - b\n```\nFixed:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert "a + b" in extract_code(two, "add")
    assert extract_code("Sure.\ndef add(a, b):\n    return a + b\nThat's it.", "add").startswith("def add")
    assert extract_code("```\nimport math\n```", "add") == "import math\n"
    assert extract_code("no code here", "add") == ""


def test_code_right_wrong_and_partial():
    env = CodeEnv(FAST)
    task = _code_task("fizzbuzz", [[3], [5], [15], [7]], ["Fizz", "Buzz", "FizzBuzz", "7"])
    right = ("def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n"
             "        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)")
    good = env.score(task, _fenced(right))
    assert good.reward == 1.0 and good.error is None and good.details["all_passed"]
    partial = env.score(task, _fenced("def fizzbuzz(n):\n    return 'Fizz' if n % 3 == 0 else str(n)"))
    assert partial.reward == 0.5 and partial.error is None and partial.details["passed"] == 2
    raw = env.score(task, right + "\n\nThis checks 15 first, then 3 and 5.")     # unfenced, prose after
    assert raw.reward == 1.0
    crash = env.score(task, _fenced("def fizzbuzz(n):\n    return 1 / 0"))
    assert crash.reward == 0.0 and "ZeroDivisionError" in crash.details["failures"][0]["got"]
    assert "SyntaxError" in env.score(task, _fenced("def fizzbuzz(n) return n")).error
    assert "defines no function" in env.score(task, _fenced("def fizz(n):\n    return n")).error


def test_code_types_are_checked_strictly_for_bools_and_loosely_for_floats():
    env = CodeEnv(FAST)
    even = _code_task("is_even", [[2], [3]], [True, False])
    assert env.score(even, _fenced("def is_even(n):\n    return n % 2 == 0")).reward == 1.0
    assert env.score(even, _fenced("def is_even(n):\n    return 1 - n % 2")).reward == 0.0
    mean = _code_task("mean", [[[1, 2]], [[0.1, 0.2]]], [1.5, 0.15000000000000002])
    assert env.score(mean, _fenced("def mean(xs):\n    return sum(xs) / len(xs)")).reward == 1.0


def test_template_tasks_are_solvable():
    """Expected values survive the trip through JSON: a right solution, run in the sandbox, passes."""
    bodies = {"add": "args[0] + args[1]", "reverse string": "args[0][::-1]", "average": "sum(args[0]) / len(args[0])",
              "is leap year": "args[0] % 4 == 0 and (args[0] % 100 != 0 or args[0] % 400 == 0)",
              "celsius to fahrenheit": "args[0] * 9 / 5 + 32", "count char": "args[0].count(args[1])",
              "multiply": "args[0] * args[1]", "is palindrome": "args[0] == args[0][::-1]"}
    env = CodeEnv(FAST)
    tasks = itertools.chain(itertools.islice(env.tasks("train", 0), 500),
                            itertools.islice(env.tasks("heldout", 0), 100))
    found = {}
    for task in tasks:
        found.setdefault(task.data["template"], task)
    assert set(bodies) <= set(found)
    for key, body in bodies.items():
        task = found[key]
        code = f"def {task.data['function']}(*args):\n    return {body}"
        assert env.score(task, _fenced(code)).reward == 1.0, (key, code)


# ---- code: hostile answers -----------------------------------------------------------------------------

def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    task = _code_task("f", [[1]], [1])
    for code in ("while True:\n    pass", "def f(n):\n    while True:\n        n += 1"):
        started = time.monotonic()
        score = CodeEnv(FAST).score(task, _fenced(code))
        assert time.monotonic() - started < FAST.wall_s + 1.0
        assert score.reward == 0.0 and "timeout" in score.error


def test_memory_bomb_fails_and_the_host_survives():
    task = _code_task("f", [[1]], [1])
    top = CodeEnv(FAST).score(task, _fenced("x = ' ' * 10**10\ndef f(n):\n    return n"))
    assert top.reward == 0.0 and "MemoryError" in top.error
    inside = CodeEnv(FAST).score(task, _fenced("def f(n):\n    return len([0] * 10**10)"))
    assert inside.reward == 0.0 and "MemoryError" in inside.details["failures"][0]["got"]


def test_writes_and_deletes_stay_in_a_temporary_directory_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    code = ("import os, shutil\n"
            "def f(n):\n"
            "    open('pwned.txt', 'w').write('x')\n"
            "    for name in os.listdir('.'):\n"
            "        if name != 'pwned.txt':\n"
            "            shutil.rmtree(name, ignore_errors=True)\n"
            "    os.system('rm -rf ./*')\n"
            "    print('CWD', os.getcwd(), sorted(os.listdir('.')))\n"
            "    return n")
    score = CodeEnv(FAST).score(_code_task("f", [[1]], [1]), _fenced(code))
    assert score.reward == 1.0
    cwd = score.details["stdout"].split()[1]
    assert "pwned.txt" in score.details["stdout"] and cwd != str(tmp_path) and not os.path.exists(cwd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "mine"


def test_files_outside_the_sandbox_are_out_of_reach(tmp_path):
    if isolation().uid is None:
        pytest.skip("the sandbox runs as the scorer's own user here: its files are not protected")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("precious")
    code = ("import shutil\n"
            f"def f(n):\n    shutil.rmtree({str(victim)!r})\n    return n")
    score = CodeEnv(FAST).score(_code_task("f", [[1]], [1]), _fenced(code))
    assert score.reward == 0.0 and "PermissionError" in score.details["failures"][0]["got"]
    assert (victim / "data.txt").read_text() == "precious"


def test_network_is_unreachable(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    bypass = isolation().prefix != ()          # in a network namespace even the real socket type fails
    code = ("import socket\n"
            "def f(n):\n"
            "    tries = [lambda: socket.create_connection(('127.0.0.1', %d), timeout=0.5)]\n"
            "    if %r:\n"
            "        real = [c for c in object.__subclasses__() if c.__name__ == 'socket'][0]\n"
            "        tries.append(lambda: real(socket.AF_INET, socket.SOCK_STREAM).connect(('127.0.0.1', %d)))\n"
            "    for attempt in tries:\n"
            "        try:\n"
            "            attempt()\n"
            "            return 'connected'\n"
            "        except OSError:\n"
            "            pass\n"
            "    return 'blocked'" % (port, bypass, port))
    try:
        score = CodeEnv(FAST).score(_code_task("f", [[1]], ["blocked"]), _fenced(code))
        assert score.reward == 1.0, score
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_fork_bomb_is_contained():
    if not isolation().processes_limited:
        pytest.skip("RLIMIT_NPROC is not enforced for the sandbox user here (root without `nobody`)")
    code = ("import os, threading\n"
            "def f(n):\n"
            "    made = 0\n"
            "    for _ in range(1000):\n"
            "        try:\n"
            "            if os.fork() == 0:\n"
            "                os._exit(0)\n"
            "            made += 1\n"
            "        except OSError:\n"
            "            pass\n"
            "    try:\n"
            "        threading.Thread(target=print).start()\n"
            "        made += 1\n"
            "    except RuntimeError:\n"
            "        pass\n"
            "    return made")
    started = time.monotonic()
    score = CodeEnv(FAST).score(_code_task("f", [[1]], [0]), _fenced(code))
    assert score.reward == 1.0, score.details                   # not one fork or thread got through
    bomb = CodeEnv(FAST).score(_code_task("f", [[1]], [1]), _fenced("import os\nwhile True:\n    os.fork()"))
    assert bomb.reward == 0.0 and "BlockingIOError" in bomb.error
    assert time.monotonic() - started < 3 * FAST.wall_s


def test_output_flood_is_capped():
    limits = Limits(wall_s=2.0, file_bytes=1 << 20, shown_bytes=1000)
    outcome = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=limits)
    assert not outcome.timed_out and outcome.returncode == 1 and "File too large" in outcome.stderr
    assert outcome.stdout == "x" * 1000 and outcome.output_truncated
    score = CodeEnv(FAST).score(_code_task("f", [[1]], [1]), _fenced("def f(n):\n    print('y' * 10**7)\n    return n"))
    assert score.reward == 0.0 and len(score.details["stdout"]) <= 500


def test_exiting_early_or_forging_results_cannot_fake_a_pass():
    task = _code_task("f", [[1], [2]], [11, 22])
    for code in ("import sys\nsys.exit(0)",
                 "import os\ndef f(n):\n    os._exit(0)",
                 "import os, sys\nfd = int(sys.argv[1])\n"
                 "os.write(fd, b'{\"stage\": \"loaded\"}\\n{\"i\": 0, \"value\": 1}\\n{\"stage\": \"done\"}\\n')\n"
                 "os._exit(0)"):
        assert CodeEnv(FAST).score(task, _fenced(code)).reward == 0.0, code


def test_the_child_inherits_no_environment(monkeypatch):
    monkeypatch.setenv("SPECRL_ADMIN_TOKEN", "secret-token")
    outcome = run_python("import os\nprint(sorted(os.environ))", limits=FAST)
    assert "SPECRL_ADMIN_TOKEN" not in outcome.stdout and "secret" not in outcome.stdout


# ---- format --------------------------------------------------------------------------------------------

_RIGHT_WRONG = [
    ({"kind": "bullets", "n": 3}, "Here:\n- one thing\n- two things\n- three things", "- one thing\n- two things"),
    ({"kind": "paragraphs", "n": 2}, "First part of it.\n\nSecond part of it.", "All of it in one paragraph here."),
    ({"kind": "json", "keys": ["answer", "reason"]}, '```json\n{"answer": "yes", "reason": "it is so"}\n```',
     '{"answer": "yes", "why": "it is so"}'),
    ({"kind": "quoted"}, '"This is all of it."', 'This is "not" quoted.'),
    ({"kind": "lowercase"}, "all of this is lowercase.", "Not all of this is lowercase."),
    ({"kind": "uppercase"}, "ALL OF THIS IS LOUD!", "ALL OF THIS IS loud"),
    ({"kind": "max_words", "n": 5}, "Only four words here.", "This reply has six words."),
    ({"kind": "min_words", "n": 5}, "This reply has six words.", "Only four words here."),
    ({"kind": "starts_with", "word": "Sure"}, "Sure! Happy to help.", "Of course, sure thing."),
    ({"kind": "title"}, "<<On Tides>>\nThe moon pulls.", "On Tides: the moon pulls."),
    ({"kind": "ends_with", "word": "DONE"}, "That is all there is. DONE.", "DONE is what I am, not yet."),
    ({"kind": "no_commas"}, "No commas in this one.", "Well, here is one."),
    ({"kind": "keyword", "word": "simple"}, "Simple idea, simple words.", "A simple idea in plain words."),
]


@pytest.mark.parametrize("constraint, right, wrong", _RIGHT_WRONG, ids=[c["kind"] for c, _, _ in _RIGHT_WRONG])
def test_format_constraint_right_and_wrong(constraint, right, wrong):
    task = Task("f", "?", "train", {"constraints": [constraint]})
    assert FormatEnv().score(task, right).reward == 1.0
    assert FormatEnv().score(task, wrong).reward == 0.0
    assert instruction(constraint).endswith(".")


def test_format_gives_partial_credit_and_nothing_for_an_empty_reply():
    task = Task("f", "?", "train", {"constraints": [{"kind": "lowercase"}, {"kind": "max_words", "n": 5}]})
    half = FormatEnv().score(task, "this reply is lowercase but too long")
    assert half.reward == 0.5 and half.details["checks"] == {"lowercase": True, "max_words": False}
    empty = FormatEnv().score(task, "  ")
    assert empty.reward == 0.0 and "under" in empty.error


def test_format_constraints_never_contradict_each_other():
    assert len(_RIGHT_WRONG) == len(CONSTRAINTS)
    by_kind = {c.kind: c for c in CONSTRAINTS}
    for task in itertools.islice(FormatEnv().tasks("train", 0), 500):
        pair = [by_kind[c["kind"]] for c in task.data["constraints"]]
        if len(pair) == 2:
            a, b = pair
            assert a.slot != b.slot and a.slot not in b.excludes and b.slot not in a.excludes
