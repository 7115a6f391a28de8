"""Code tasks: write one small Python function; the reward is the fraction of its unit tests passed.

Tasks come from TEMPLATES (add, reverse a string, count vowels, fizzbuzz, ...): each draws a
function name, parameter names, one worked example and TESTS_PER_TASK test calls from a seeded
`random.Random`; the expected values come from the template's reference implementation, here in
the parent, and never reach the child. Held out: the HELDOUT_FRACTION of templates that sort
first by crc32 of their key (the rule of `specrl.data.prompts`), so held-out tasks ask for
functions never asked for in training. They are easy: the base model solves them all greedily,
so this environment is a quick smoke test of the loop; measure code with `humaneval`.

Scoring
  1. extract the code: the last ```python (or bare ```) block that defines the function, else all
     Python blocks joined, else the text from its first line starting with def/import/from/class
  2. run it in the sandbox (`sandbox.run_python`: its own process, time, memory and process limits,
     a temporary directory, no network) under a small harness that executes the code, calls the
     function on each test's arguments and writes each return value (as JSON) to its results file
  3. compare each value with the expected one here: bools must be bools, numbers within 1e-6
     (relative, for large ones), lists element by element, anything else by ==
Reward = tests passed / tests (partial credit gives a small model a gradient). A run that does not
finish (timeout, a resource limit, a crash) or code that cannot be loaded (no code, syntax error,
no such function, an exception at import) scores 0 with the reason in `error`. Code that stops
being Python at some line (prose after an unfenced answer, a cut-off reply) runs up to that line.

The child cannot fake a pass by exiting early or printing: passes are counted here, from values
the child had to compute. (Code that reads the harness's frames still only sees arguments.)
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from specrl.data.prompts import heldout_topics
from specrl.trainer.envs.base import Score, Task, check_split, task_id
from specrl.trainer.envs.sandbox import Limits, isolation, run_python
from specrl.trainer.envs.solution import HARNESS_PRELUDE, MAX_CODE_CHARS, defines, python_blocks, result_records

TESTS_PER_TASK = 5

_HARNESS = HARNESS_PRELUDE + r"""
def _emit(**record):
    _out.write(json.dumps(record) + "\n")
_namespace, _ = _load("", _job["code"], _job["function"], _emit)
_function = _namespace[_job["function"]]
_emit(stage="loaded")
for _i, _args in enumerate(_job["calls"]):
    try:
        _value = _function(*_args)
    except BaseException as exc:
        _emit(i=_i, error=_error(exc))
        continue
    try:
        _emit(i=_i, value=_value)
    except (TypeError, ValueError):
        _emit(i=_i, error="not JSON: " + repr(_value)[:200])
_emit(stage="done")
_finish()
"""


@dataclass(frozen=True)
class Template:
    key: str                                        # decides the split
    names: tuple[str, ...]                          # function names to choose from
    params: tuple[tuple[str, ...], ...]             # parameter-name tuples to choose from
    says: str                                       # "returns the sum of {0} and {1}" ({name} allowed)
    reference: Callable[..., Any]
    draw: Callable[[random.Random], tuple]          # one tuple of test arguments


class CodeEnv:
    name = "code"

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        check_split(split)
        held = heldout_topics([t.key for t in TEMPLATES])
        templates = [t for t in TEMPLATES if (t.key in held) == (split == "heldout")]
        rng = random.Random(f"code/{split}/{seed}")
        while True:
            yield _write(rng, rng.choice(templates), split)

    def score(self, task: Task, completion: str) -> Score:
        code = extract_code(completion, task.data["function"])
        details: dict[str, Any] = {"passed": 0, "tests": len(task.data["calls"]), "all_passed": False}
        if not code.strip():
            return Score(0.0, details, "no code in the completion")
        if len(code) > MAX_CODE_CHARS:
            return Score(0.0, details, f"code longer than {MAX_CODE_CHARS} characters")
        job = json.dumps({"code": code, "function": task.data["function"], "calls": task.data["calls"]})
        outcome = run_python(_HARNESS, job.encode(), self.limits)
        records = result_records(outcome.results)
        details.update(stdout=outcome.stdout[:500], stderr=outcome.stderr[-500:], elapsed_s=round(outcome.elapsed_s, 3),
                       sandbox=isolation().network)
        load = next((r for r in records if r.get("stage") == "load"), None)
        failure = outcome.failure or (load and f"load failed: {load.get('error')}")
        if failure or not any(r.get("stage") == "done" for r in records):
            return Score(0.0, details, failure or "the harness did not finish")
        results = {r["i"]: r for r in reversed(records) if isinstance(r.get("i"), int)}   # first record per test
        checks = [_check(results.get(i), expected) for i, expected in enumerate(task.data["expected"])]
        passed = sum(ok for ok, _ in checks)
        details.update(passed=passed, all_passed=passed == len(checks),
                       failures=[{"call": task.data["calls"][i], "expected": task.data["expected"][i], "got": got}
                                 for i, (ok, got) in enumerate(checks) if not ok][:3])
        return Score(passed / len(checks), details)


def extract_code(completion: str, function: str) -> str:
    """The Python code of a completion (see the module docstring for the rule)."""
    blocks = python_blocks(completion)
    defining = [b for b in blocks if defines(b, function)]
    if defining:
        return defining[-1]
    if blocks:
        return "\n".join(blocks)
    lines = completion.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"(def|import|from|class)\s", line)), len(lines))
    return "\n".join(lines[start:])


def _check(record: dict | None, expected: Any) -> tuple[bool, Any]:
    if record is None:
        return False, None
    if "error" in record:
        return False, record["error"]
    return _same(record.get("value"), expected), record.get("value")


def _same(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return type(value) is type(expected) and value == expected
    if isinstance(expected, (int, float)) and isinstance(value, (int, float)):
        return math.isfinite(value) and abs(value - expected) <= 1e-6 * max(1.0, abs(expected))
    if isinstance(expected, list) and isinstance(value, list):
        return len(value) == len(expected) and all(_same(v, e) for v, e in zip(value, expected))
    return value == expected


def _write(rng: random.Random, template: Template, split: str) -> Task:
    name, params = rng.choice(template.names), rng.choice(template.params)
    example = template.draw(rng)
    calls = [list(template.draw(rng)) for _ in range(TESTS_PER_TASK)]
    expected = [_as_json(template.reference(*args)) for args in calls]
    says = template.says.format(*(f"`{p}`" for p in params), name=f"`{name}`")
    shown = f"{name}({', '.join(repr(a) for a in example)})"
    prompt = (f"Write a Python function `{name}({', '.join(params)})` that {says}. For example, `{shown}` should "
              f"return `{template.reference(*example)!r}`. Reply with only the code, in a ```python block.")
    return Task(task_id("code", prompt + json.dumps(calls)), prompt, split,
                {"function": name, "calls": calls, "expected": expected, "template": template.key})


def _as_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


# ---- templates ---------------------------------------------------------------------------------------

_WORDS = ("apple", "banana", "level", "racecar", "python", "Sandbox", "queue", "noon", "kayak", "Hello",
          "world", "data", "stream", "Madam", "refer", "rotor", "civic", "tensor", "drafter", "token", "a", "")


def _ints(lo: int, hi: int, k: int = 1) -> Callable[[random.Random], tuple]:
    return lambda rng: tuple(rng.randint(lo, hi) for _ in range(k))


def _int_list(lo: int, hi: int, min_len: int = 1) -> Callable[[random.Random], tuple]:
    return lambda rng: ([rng.randint(lo, hi) for _ in range(rng.randint(min_len, 7))],)


def _word(rng: random.Random) -> tuple:
    return (rng.choice(_WORDS),)


def _sentence(rng: random.Random) -> tuple:
    return (" ".join(rng.choice(_WORDS[:-1]) for _ in range(rng.randint(1, 6))),)


def _spaced(rng: random.Random) -> tuple:
    return ("".join(rng.choice(("", " ", "  ")) + rng.choice(_WORDS) for _ in range(rng.randint(1, 4))) +
            rng.choice(("", " ")),)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _fizzbuzz(n: int) -> str:
    return "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n)


_ONE_LIST = (("numbers",), ("values",), ("xs",))
_ONE_TEXT = (("s",), ("text",), ("word",))
TEMPLATES: tuple[Template, ...] = (
    Template("add", ("add", "add_numbers", "plus"), (("a", "b"), ("x", "y")), "returns the sum of {0} and {1}",
             lambda a, b: a + b, _ints(-100, 100, 2)),
    Template("subtract", ("subtract", "difference", "minus"), (("a", "b"), ("x", "y")), "returns {0} minus {1}",
             lambda a, b: a - b, _ints(-100, 100, 2)),
    Template("multiply", ("multiply", "product", "times"), (("a", "b"), ("x", "y")),
             "returns the product of {0} and {1}", lambda a, b: a * b, _ints(-20, 20, 2)),
    Template("square", ("square", "squared"), (("n",), ("x",)), "returns {0} squared", lambda n: n * n,
             _ints(-30, 30)),
    Template("is even", ("is_even", "even"), (("n",), ("x",)), "returns True if {0} is even and False otherwise",
             lambda n: n % 2 == 0, _ints(-50, 50)),
    Template("is odd", ("is_odd", "odd"), (("n",), ("x",)), "returns True if {0} is odd and False otherwise",
             lambda n: n % 2 == 1, _ints(-50, 50)),
    Template("absolute value", ("absolute", "abs_value", "magnitude"), (("n",), ("x",)),
             "returns the absolute value of the number {0}", abs, _ints(-100, 100)),
    Template("reverse string", ("reverse_string", "reverse", "backwards"), _ONE_TEXT,
             "returns the string {0} reversed", lambda s: s[::-1], _word),
    Template("count vowels", ("count_vowels", "vowel_count", "num_vowels"), _ONE_TEXT,
             "returns how many vowels (a, e, i, o, u, upper or lower case) the string {0} contains",
             lambda s: sum(c in "aeiouAEIOU" for c in s), _sentence),
    Template("max of list", ("max_of_list", "largest", "find_max"), _ONE_LIST,
             "returns the largest number in the non-empty list {0}", max, _int_list(-50, 50)),
    Template("min of list", ("min_of_list", "smallest", "find_min"), _ONE_LIST,
             "returns the smallest number in the non-empty list {0}", min, _int_list(-50, 50)),
    Template("sum of list", ("sum_list", "total", "list_sum"), _ONE_LIST,
             "returns the sum of the numbers in the list {0} (0 for an empty list)", sum, _int_list(-50, 50, 0)),
    Template("average", ("average", "mean", "list_mean"), _ONE_LIST,
             "returns the average (arithmetic mean) of the non-empty list of numbers {0}",
             lambda xs: sum(xs) / len(xs), _int_list(0, 100)),
    Template("count positive", ("count_positive", "num_positive", "positives"), _ONE_LIST,
             "returns how many numbers in the list {0} are greater than zero",
             lambda xs: sum(x > 0 for x in xs), _int_list(-10, 10, 0)),
    Template("last element", ("last_element", "last", "final_item"), (("items",), ("xs",)),
             "returns the last element of the non-empty list {0}", lambda xs: xs[-1], _int_list(0, 99)),
    Template("factorial", ("factorial", "fact"), (("n",),), "returns the factorial of {0} ({name} of 0 is 1)",
             math.factorial, _ints(0, 10)),
    Template("fibonacci", ("fibonacci", "fib"), (("n",),),
             "returns the {0}-th Fibonacci number, where {name} of 0 is 0 and {name} of 1 is 1", _fib, _ints(0, 20)),
    Template("fizzbuzz", ("fizzbuzz", "fizz_buzz"), (("n",),),
             "returns 'FizzBuzz' if {0} is divisible by both 3 and 5, 'Fizz' if only by 3, 'Buzz' if only by 5, "
             "and otherwise {0} as a string", _fizzbuzz, _ints(1, 100)),
    Template("is prime", ("is_prime", "prime"), (("n",),), "returns True if {0} is a prime number, else False",
             _is_prime, _ints(0, 100)),
    Template("gcd", ("gcd", "greatest_common_divisor"), (("a", "b"),),
             "returns the greatest common divisor of the positive integers {0} and {1}", math.gcd, _ints(1, 120, 2)),
    Template("sum of digits", ("sum_digits", "digit_sum"), (("n",),),
             "returns the sum of the decimal digits of the non-negative integer {0}",
             lambda n: sum(int(d) for d in str(n)), _ints(0, 99999)),
    Template("is palindrome", ("is_palindrome", "palindrome"), _ONE_TEXT,
             "returns True if the string {0} reads the same forwards and backwards (case matters), else False",
             lambda s: s == s[::-1], _word),
    Template("count char", ("count_char", "occurrences"), (("s", "c"), ("text", "ch")),
             "returns how many times the character {1} appears in the string {0}", lambda s, c: s.count(c),
             lambda rng: (_sentence(rng)[0], rng.choice("aeiont"))),
    Template("to upper", ("to_upper", "shout", "upper"), _ONE_TEXT, "returns the string {0} in upper case",
             str.upper, _sentence),
    Template("repeat string", ("repeat", "repeat_string"), (("s", "n"), ("text", "times")),
             "returns the string {0} repeated {1} times", lambda s, n: s * n,
             lambda rng: (rng.choice(_WORDS), rng.randint(0, 4))),
    Template("count words", ("count_words", "word_count"), (("sentence",), ("text",)),
             "returns the number of words in {0}, where words are separated by single spaces",
             lambda s: len(s.split()), _sentence),
    Template("remove spaces", ("remove_spaces", "strip_spaces", "no_spaces"), _ONE_TEXT,
             "returns the string {0} with every space removed", lambda s: s.replace(" ", ""), _spaced),
    Template("clamp", ("clamp", "limit"), (("x", "lo", "hi"), ("value", "low", "high")),
             "returns {1} if {0} is below {1}, {2} if {0} is above {2}, and {0} otherwise",
             lambda x, lo, hi: max(lo, min(hi, x)), lambda rng: (rng.randint(-20, 40), rng.randint(-5, 5),
                                                                 rng.randint(10, 20))),
    Template("celsius to fahrenheit", ("celsius_to_fahrenheit", "c_to_f", "to_fahrenheit"), (("celsius",), ("c",)),
             "converts the temperature {0} from degrees Celsius to Fahrenheit (F = C * 9 / 5 + 32)",
             lambda c: c * 9 / 5 + 32, _ints(-40, 100)),
    Template("is leap year", ("is_leap_year", "leap_year", "is_leap"), (("year",),),
             "returns True if {0} is a leap year in the Gregorian calendar, else False",
             lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0),
             lambda rng: (rng.choice((1900, 2000, 2023, 2024, 2100, 1996, 2400, 1999)) if rng.random() < 0.5
                          else rng.randint(1800, 2200),)),
    Template("first word", ("first_word", "head_word"), (("sentence",), ("text",)),
             "returns the first word of the non-empty sentence {0} (words are separated by single spaces)",
             lambda s: s.split()[0], _sentence),
)
