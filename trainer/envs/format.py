"""Format and instruction following: answer a chat question under one or two checkable constraints.

Tasks: a question from the project's chat prompts (`specrl.data.load_prompts("chat", split, seed)`;
those asking for bullets or a table are left out) followed by one or two constraints from
CONSTRAINTS ("Answer in exactly 3 bullet points.", "Use fewer than 20 words.", "Write your whole
reply in lowercase letters.", ...), drawn with their parameters from a seeded `random.Random`.
Two constraints never contradict each other: each has a slot (shape, case, length, start, end,
...) and the slots it excludes. Splits follow the chat prompts (held out by topic), so held-out
tasks ask the same kinds of constraints about questions never seen in training.

Scoring: reward = the fraction of the task's constraints the reply meets, each checked exactly
by code (no model judges). A reply with fewer than MIN_WORDS words (runs of letters or digits)
scores 0 with an error, so that saying nothing cannot satisfy "fewer than 20 words".
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from specrl.data import load_prompts
from specrl.trainer.envs.base import Score, Task, check_split, task_id

MIN_WORDS = 3
_KEY_SETS = (("answer", "reason"), ("summary", "confidence"), ("title", "points"), ("topic", "explanation"),
             ("short_answer", "details"), ("claim", "evidence", "caveat"))
_END_WORDS = ("DONE", "END", "Finished", "Goodbye")
_START_WORDS = ("Sure", "Okay", "Well", "Honestly")
_KEYWORDS = ("important", "example", "simple", "because")


@dataclass(frozen=True)
class Constraint:
    kind: str
    slot: str                                           # two constraints never share a slot
    excludes: frozenset[str]                            # slots it cannot be combined with
    draw: Callable[[random.Random], dict[str, Any]]     # its parameters
    say: str                                            # the instruction, formatted with the parameters
    check: Callable[..., bool]                          # check(reply, **parameters)


def _bullets(reply: str, n: int) -> bool:
    return len(re.findall(r"^\s*[-*\u2022]\s+\S", reply, re.MULTILINE)) == n


def _json_keys(reply: str, keys: list[str]) -> bool:
    text = re.sub(r"^\s*```(?:json)?\s*\n(.*?)\n\s*```\s*$", r"\1", reply, flags=re.DOTALL)
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(keys)


def _paragraphs(reply: str, n: int) -> bool:
    return len([p for p in re.split(r"\n\s*\n", reply.strip()) if p.strip()]) == n


def _say_keys(keys: list[str]) -> str:
    quoted = [f'"{k}"' for k in keys]
    return ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _one(rng: random.Random, key: str, values) -> dict[str, Any]:
    return {key: rng.choice(values)}


CONSTRAINTS: tuple[Constraint, ...] = (
    Constraint("bullets", "shape", frozenset(), lambda rng: _one(rng, "n", (2, 3, 4, 5)),
               "Answer in exactly {n} bullet points, each on its own line starting with '- '.", _bullets),
    Constraint("paragraphs", "shape", frozenset(), lambda rng: _one(rng, "n", (2, 3)),
               "Write exactly {n} paragraphs, separated by a blank line.", _paragraphs),
    Constraint("json", "shape", frozenset({"case", "start", "end", "commas"}),
               lambda rng: {"keys": list(rng.choice(_KEY_SETS))},
               "Reply with only a JSON object that has exactly the keys {keys_said}.", _json_keys),
    Constraint("quoted", "shape", frozenset({"start", "end"}), lambda rng: {},
               "Wrap your entire reply in double quotation marks.",
               lambda reply: re.fullmatch(r'\s*["\u201c].*["\u201d]\s*', reply, re.DOTALL) is not None),
    Constraint("lowercase", "case", frozenset(), lambda rng: {},
               "Write your whole reply in lowercase letters, with no capital letters at all.",
               lambda reply: reply == reply.lower()),
    Constraint("uppercase", "case", frozenset(), lambda rng: {}, "Write your whole reply in capital letters.",
               lambda reply: reply == reply.upper()),
    Constraint("max_words", "length", frozenset(), lambda rng: _one(rng, "n", (15, 20, 30, 40, 50)),
               "Use fewer than {n} words.", lambda reply, n: len(reply.split()) < n),
    Constraint("min_words", "length", frozenset(), lambda rng: _one(rng, "n", (40, 60, 80)),
               "Use at least {n} words.", lambda reply, n: len(reply.split()) >= n),
    Constraint("starts_with", "start", frozenset({"case"}), lambda rng: _one(rng, "word", _START_WORDS),
               "Start your reply with the word '{word}'.",
               lambda reply, word: re.match(rf"\W*{word}\b", reply) is not None),
    Constraint("title", "start", frozenset(), lambda rng: {},
               "Begin with a title wrapped in double angle brackets, like <<my title>>.",
               lambda reply: re.match(r"\s*<<[^<>\n]+>>", reply) is not None),
    Constraint("ends_with", "end", frozenset({"case"}), lambda rng: _one(rng, "word", _END_WORDS),
               "End your reply with the word '{word}'.",
               lambda reply, word: re.search(rf"\b{word}\W*$", reply) is not None),
    Constraint("no_commas", "commas", frozenset(), lambda rng: {}, "Do not use any commas.",
               lambda reply: "," not in reply),
    Constraint("keyword", "keyword", frozenset(), lambda rng: _one(rng, "word", _KEYWORDS),
               "Use the word '{word}' at least twice.",
               lambda reply, word: len(re.findall(rf"\b{word}\b", reply, re.IGNORECASE)) >= 2),
)
_BY_KIND = {c.kind: c for c in CONSTRAINTS}


class FormatEnv:
    name = "format"

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        check_split(split)
        rng = random.Random(f"format/{split}/{seed}")
        questions = [p.text for p in load_prompts("chat", split, seed)
                     if "bullet" not in p.text and "table" not in p.text]
        queue: list[str] = []
        while True:
            if not queue:
                queue = rng.sample(questions, len(questions))      # every question once per pass
            chosen = _draw_constraints(rng, 1 if rng.random() < 0.5 else 2)
            prompt = " ".join([queue.pop(), *(instruction(c) for c in chosen)])
            yield Task(task_id("format", prompt), prompt, split, {"constraints": chosen})

    def score(self, task: Task, completion: str) -> Score:
        constraints = task.data["constraints"]
        if len(re.findall(r"\w+", completion)) < MIN_WORDS:
            return Score(0.0, {"met": 0, "constraints": len(constraints)}, f"reply under {MIN_WORDS} words")
        met = {c["kind"]: bool(_BY_KIND[c["kind"]].check(completion, **_params(c))) for c in constraints}
        return Score(sum(met.values()) / len(met), {"met": sum(met.values()), "constraints": len(met), "checks": met})


def instruction(constraint: dict[str, Any]) -> str:
    """The sentence that asks for one constraint ({"kind": ..., parameters...})."""
    params = _params(constraint)
    if "keys" in params:
        params["keys_said"] = _say_keys(params["keys"])
    return _BY_KIND[constraint["kind"]].say.format(**params)


def _params(constraint: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in constraint.items() if k != "kind"}


def _draw_constraints(rng: random.Random, k: int) -> list[dict[str, Any]]:
    chosen: list[Constraint] = []
    while len(chosen) < k:
        options = [c for c in CONSTRAINTS if all(
            c.slot != o.slot and c.slot not in o.excludes and o.slot not in c.excludes for o in chosen)]
        chosen.append(rng.choice(options))
    return [{"kind": c.kind, **c.draw(rng)} for c in chosen]
