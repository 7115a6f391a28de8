"""Arithmetic and math word problems with exact answers.

Tasks
  plain     one operation on small numbers ("What is 7 * 8?"): + and - on 0..50, * on 2..12, exact /
            with divisor and quotient in 2..12 and 1..12. Small on purpose: a 135M model gets some
            right, so a group of samples has a reward signal to learn from.
  word      the project's math prompts (`specrl.data.load_prompts("math", split, seed)`): word problems
            and larger arithmetic, each with its exact answer computed in code.
Each prompt ends with ANSWER_FORMAT, which asks for a last line "Answer: <number>".

Splits: a plain problem's split is fixed by crc32 of its expression ("7 * 8"), HELDOUT_FRACTION of
expressions held out, so the same problem never lands in both splits; word problems keep the
split of their prompt set (held out by topic).

Scoring: exact match of one extracted number with the answer (|x - answer| <= 1e-6). The number
is, in this order, the content of the last \\boxed{...}, the first number after the last
"Answer:" (or "answer is"), else the last number in the completion. Numbers may carry a sign,
a "$", thousands commas ("1,234"), decimals, a trailing period; "3/4" and \\frac{3}{4} count in
the first two forms. A completion without a number scores 0 with error "no number ...".
"""

from __future__ import annotations

import random
import re
import zlib
from fractions import Fraction
from typing import Iterator

from specrl.data import load_prompts
from specrl.data.prompts import HELDOUT_FRACTION, format_number
from specrl.trainer.envs.base import Score, Task, check_split, task_id

ANSWER_FORMAT = "Finish with a last line of the form 'Answer: <number>'."
TOLERANCE = 1e-6

_SIGN = r"(?:(?<![\w)\]])[-\u2212])?"             # a minus that is not a binary minus ("10-5" is 10 and 5)
_NUMBER = re.compile(_SIGN + r"\$?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_FRACTION = re.compile(r"^\s*\$?(" + _SIGN + r"\d+)\s*/\s*(\d+)\b|\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_ANSWER = re.compile(r"\banswer\b(?:\s+is)?\s*\**\s*[:=]?\s*\**(.*)", re.IGNORECASE)


class ArithmeticEnv:
    name = "arithmetic"

    def __init__(self, word_fraction: float = 0.25):
        if not 0.0 <= word_fraction <= 1.0:
            raise ValueError(f"word_fraction is a probability in [0, 1]; got {word_fraction!r}")
        self.word_fraction = word_fraction

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        check_split(split)
        rng = random.Random(f"arithmetic/{split}/{seed}")
        words = load_prompts("math", split, seed)
        queue: list = []
        while True:
            if rng.random() < self.word_fraction:
                if not queue:
                    queue = rng.sample(words, len(words))      # every word problem once per pass
                prompt = queue.pop()
                yield _task(prompt.text, prompt.answer, split, f"word:{prompt.topic}")
            else:
                yield _plain(rng, split)

    def score(self, task: Task, completion: str) -> Score:
        expected = Fraction(task.data["answer"])
        found, method = extract_answer(completion)
        details = {"expected": task.data["answer"], "extracted": None if found is None else format_number_loose(found),
                   "method": method}
        if found is None:
            return Score(0.0, details, "no number in the completion")
        return Score(1.0 if abs(found - expected) <= TOLERANCE else 0.0, details)


def extract_answer(completion: str) -> tuple[Fraction | None, str | None]:
    """The number a completion gives as its answer, and how it was found ("boxed", "answer", "last")."""
    boxed = _BOXED.findall(completion)
    if boxed and (value := _first_value(boxed[-1])) is not None:
        return value, "boxed"
    for rest in reversed(_ANSWER.findall(completion)):             # the last "Answer:" that gives a number
        if (value := _first_value(rest)) is not None:
            return value, "answer"
    numbers = _NUMBER.findall(completion)
    return (_number(numbers[-1]), "last") if numbers else (None, None)


def format_number_loose(x: Fraction) -> str:
    """A readable form of an extracted number (exact when it has at most two decimals)."""
    try:
        return format_number(x)
    except ValueError:
        return f"{float(x):.6g}"


def _first_value(text: str) -> Fraction | None:
    fraction = _FRACTION.search(text)
    if fraction:
        top, bottom = (fraction.group(1), fraction.group(2)) if fraction.group(1) else fraction.group(3, 4)
        if int(bottom) != 0:
            return Fraction(int(top.replace("\u2212", "-")), int(bottom))
    number = _NUMBER.search(text)
    return _number(number.group(0)) if number else None


def _number(text: str) -> Fraction:
    return Fraction(text.replace(",", "").replace("$", "").replace("\u2212", "-"))


def _task(question: str, answer: str, split: str, kind: str, **data: str) -> Task:
    prompt = f"{question} {ANSWER_FORMAT}"
    return Task(task_id("arithmetic", prompt), prompt, split, {"answer": answer, "kind": kind, **data})


_PHRASES = {
    "+": ("What is {a} + {b}?", "Compute {a} + {b}.", "What is {a} plus {b}?", "Add {a} and {b}."),
    "-": ("What is {a} - {b}?", "Compute {a} - {b}.", "What is {a} minus {b}?", "Subtract {b} from {a}."),
    "*": ("What is {a} * {b}?", "Compute {a} * {b}.", "What is {a} times {b}?", "Multiply {a} by {b}."),
    "/": ("What is {a} / {b}?", "Compute {a} / {b}.", "What is {a} divided by {b}?", "Divide {a} by {b}."),
}


def _plain(rng: random.Random, split: str) -> Task:
    """One single-operation problem of `split` (drawn until its expression falls in that split)."""
    while True:
        op = rng.choice("+-*/")
        if op == "+":
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            value = a + b
        elif op == "-":
            a = rng.randint(0, 50)
            b = rng.randint(0, a)
            value = a - b
        elif op == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            value = a * b
        else:
            b, value = rng.randint(2, 12), rng.randint(1, 12)
            a = b * value
        expression = f"{a} {op} {b}"
        if plain_split(expression) == split:
            return _task(rng.choice(_PHRASES[op]).format(a=a, b=b), str(value), split, f"plain:{op}",
                         expression=expression)


def plain_split(expression: str) -> str:
    """The held-out rule for plain problems: HELDOUT_FRACTION of expressions by crc32."""
    return "heldout" if zlib.crc32(expression.encode()) % 1000 < HELDOUT_FRACTION * 1000 else "train"
