"""The project's own prompt sets: four domains, written from templates in code, with a held-out split.

Used to replay traffic through the API (`specrl up --demo`, `specrl bench adapt`), for held-out
evaluation, and to shift the traffic mix over time (domain-shift experiments).

Domains
  code        short programming requests (write, explain, fix) in Python, JavaScript, SQL and bash
  math        arithmetic and word problems; `answer` is the exact result as a canonical number
              ("42", "12.5": no trailing zeros, at most two decimals), computed in code
  chat        explanations, advice, definitions, comparisons and history across many subjects
  structured  JSON, YAML, CSV, markdown tables and lists with given fields

Each prompt is written from one TOPIC (a programming task, a code snippet, a kind of math problem,
a chat subject, a kind of record) by filling a template with slot values drawn from a
`random.Random` seeded with (seed, domain, topic): the same arguments give the same prompts on
every call and machine, and editing one topic list leaves every other topic's prompts unchanged.
`seed` changes which templates and slot values are drawn (and the numbers in math problems); it
never changes the topics or the split.

Held-out rule: within each topic list, the `HELDOUT_FRACTION` of topics that sort first by
crc32 of their name are held out, and every prompt written from them has split "heldout". A
held-out prompt therefore never shares its topic with a train prompt, so evaluation on the
held-out split measures generalisation, not memorisation. `Prompt.topic` records the topic.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import random
import zlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

from specrl.data.math_problems import MATH, Draft as _Draft, format_number, join
from specrl.data.topics import (BASH_EXTRAS, BASH_TASKS, BASH_TEMPLATES, CHAT, CHAT_EXTRAS, FORMAT_EXTRAS, FORMATS,
                                 FUNCTION_EXTRAS, FUNCTION_TASKS, FUNCTION_TEMPLATES, RECORDS, SNIPPET_TEMPLATES,
                                 SNIPPETS, SQL_EXTRAS, SQL_TASKS, SQL_TEMPLATES, STRUCTURED_EXTRAS)

DOMAINS: tuple[str, ...] = ("code", "math", "chat", "structured")
SPLITS: tuple[str, ...] = ("train", "heldout")
HELDOUT_FRACTION = 0.15


@dataclass(frozen=True)
class Prompt:
    id: str                              # "<domain>-<10 hex of sha1(text)>": the same text has the same id
    domain: str
    text: str
    split: Literal["train", "heldout"]
    answer: str | None                   # math: the exact answer as a canonical number; else None
    topic: str                           # what the prompt is about; decides the split
    slots: Mapping[str, Any] = field(default_factory=dict, hash=False, repr=False)  # values filled in


# ---- generation ------------------------------------------------------------------------------------



@dataclass(frozen=True)
class _Group:
    """One list of topics and how to write one prompt about a topic."""

    topics: tuple[str, ...]
    write: Callable[[random.Random, str], _Draft]
    per_topic: int


def _groups(domain: str) -> tuple[_Group, ...]:
    return {
        "code": (
            _Group(FUNCTION_TASKS, _fill(FUNCTION_TEMPLATES, FUNCTION_EXTRAS,
                                          kind=("write",), lang=("Python", "JavaScript")), 8),
            _Group(SQL_TASKS, _fill(SQL_TEMPLATES, SQL_EXTRAS, kind=("write",), lang=("SQL",)), 6),
            _Group(BASH_TASKS, _fill(BASH_TEMPLATES, BASH_EXTRAS, kind=("write",), lang=("bash",)), 6),
            _Group(tuple(SNIPPETS), _write_snippet, 3),
        ),
        "math": (_Group(tuple(MATH), lambda rng, topic: MATH[topic](rng), 15),),
        "chat": tuple(_Group(topics, _fill(templates, CHAT_EXTRAS[kind], kind=(kind,)), 3)
                      for kind, (topics, templates) in CHAT.items()),
        "structured": (_Group(tuple(RECORDS), _write_structured, 14),),
    }[domain]


def _fill(templates: Sequence[str], extras: Sequence[str], **choices: Sequence[str]):
    """A writer that fills one template with the topic and one value per slot, then adds an extra.

    Templates name the topic `{x}`; a topic "a|b" (a comparison) also fills `{a}` and `{b}`.
    """

    def write(rng: random.Random, topic: str) -> _Draft:
        slots = {name: rng.choice(values) for name, values in choices.items()}
        a, _, b = topic.partition("|")
        text = rng.choice(templates).format(x=topic, a=a, b=b, **slots)
        return _sentences(text, rng.choice(extras)), None, slots

    return write


def _write_snippet(rng: random.Random, name: str) -> _Draft:
    lang, code, purpose = SNIPPETS[name]
    kind = "fix" if purpose and rng.random() < 0.6 else "explain"
    ask = rng.choice(SNIPPET_TEMPLATES[kind]).format(lang=lang, purpose=purpose)
    code = rng.choice((f"```{lang.lower()}\n{code}\n```", f"```\n{code}\n```", code))   # fenced, or pasted bare
    return f"{ask}\n\n{code}", None, {"kind": kind, "lang": lang}


def _write_structured(rng: random.Random, plural: str) -> _Draft:
    one, fields = RECORDS[plural]
    fmt = rng.choice(tuple(FORMATS))
    picked = [fields[i] for i in sorted(rng.sample(range(len(fields)), rng.randint(3, min(5, len(fields)))))]
    n = rng.randint(3, 8)
    text = rng.choice(FORMATS[fmt]).format(one=one, many=plural, n=n, fields=join(picked),
                                            cols=", ".join(picked))
    extra = rng.choice(STRUCTURED_EXTRAS + FORMAT_EXTRAS.get(fmt, ()))
    return _sentences(text, extra), None, {"format": fmt, "fields": tuple(picked), "n": n}


def _sentences(*parts: str) -> str:
    text = " ".join(p for p in parts if p)
    return text[0].upper() + text[1:]


def heldout_topics(topics: Sequence[str]) -> set[str]:
    """The held-out rule: the HELDOUT_FRACTION of a list's topics that sort first by crc32."""
    n = max(1, round(HELDOUT_FRACTION * len(topics)))
    return set(sorted(topics, key=lambda t: (zlib.crc32(t.encode()), t))[:n])


@functools.cache
def _generate(domain: str, seed: int) -> tuple[Prompt, ...]:
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for group in _groups(domain):
        heldout = heldout_topics(group.topics)
        for topic in group.topics:
            rng = random.Random(f"{seed}/{domain}/{topic}")
            made = 0
            for _ in range(50 * group.per_topic):
                text, answer, slots = group.write(rng, topic)
                if text in seen or (answer is not None and (answer * 100).denominator != 1):
                    continue                     # a repeat, or a math answer with more than two decimals
                seen.add(text)
                prompts.append(Prompt(
                    id=f"{domain}-{hashlib.sha1(text.encode()).hexdigest()[:10]}", domain=domain, text=text,
                    split="heldout" if topic in heldout else "train",
                    answer=None if answer is None else format_number(answer), topic=topic,
                    slots=MappingProxyType(slots)))
                made += 1
                if made == group.per_topic:
                    break
    return tuple(prompts)


# ---- public API ------------------------------------------------------------------------------------

def _check_name(what: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; choose one of: {', '.join(valid)}")


def load_prompts(domain: str | None = None, split: str | None = None, seed: int = 0) -> list[Prompt]:
    """The prompts of one domain (None: all, in DOMAINS order) and one split (None: both).

    Deterministic: the same arguments return equal lists. Raises ValueError for an unknown
    domain or split, naming the valid ones.
    """
    if domain is not None:
        _check_name("domain", domain, DOMAINS)
    if split is not None:
        _check_name("split", split, SPLITS)
    domains = DOMAINS if domain is None else (domain,)
    return [p for d in domains for p in _generate(d, seed) if split is None or p.split == split]


def as_messages(prompt: Prompt, system: str | None = None) -> list[dict[str, str]]:
    """OpenAI chat messages for one prompt: an optional system message, then the user turn."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": prompt.text}]


def chat_token_ids(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Each prompt as a chat request's token ids: the user turn through the tokenizer's chat
    template, with the assistant's turn opened (what the server decodes after)."""
    return [list(tokenizer.apply_chat_template(as_messages(p), add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for p in prompts]


Weights = Mapping[str, float]
ShiftPoint = int | float


class PromptMix:
    """An endless, seeded stream of prompts for traffic replay, drawn from domains by weight.

    Each prompt first picks a domain with probability weight / sum(weights), then the next prompt
    of that domain from a shuffled pass over its prompts (every prompt once per pass, reshuffled
    when a pass ends), so a replay repeats a prompt only after it has used them all.

    `shift` schedules changes of the mix: a list of (at, weights), where `at` is a prompt count
    (int: prompts 0..at-1 use the earlier weights, prompt `at` onwards the new ones) or a fraction
    of `total` (float in [0, 1]; `total` is then required). Points must increase.

        PromptMix({"chat": 1}, shift=[(200, {"code": 1})])      # 200 chat prompts, then only code
        PromptMix.schedule([(0, {"chat": 1}), (200, {"code": 1})])                   # the same
        PromptMix({"chat": 3, "math": 1}, shift=[(0.5, {"code": 1})], total=1000)   # switch at 500

    Use it as an iterator (`next(mix)`, `itertools.islice(mix, n)`) or call `mix.next()`.
    """

    def __init__(self, weights: Weights, split: str | None = "train", seed: int = 0,
                 shift: Sequence[tuple[ShiftPoint, Weights]] | None = None, total: int | None = None):
        if split is not None:
            _check_name("split", split, SPLITS)
        self.phases: list[tuple[int, dict[str, float]]] = _phases([(0, weights), *(shift or ())], total)
        used = [d for d in DOMAINS if any(w.get(d, 0) > 0 for _, w in self.phases)]
        self._pools = {d: load_prompts(d, split, seed) for d in used}
        self._queues: dict[str, list[Prompt]] = {d: [] for d in used}
        self._rng = random.Random(f"mix/{seed}")
        self.drawn = 0                                      # prompts returned so far

    @classmethod
    def schedule(cls, phases: Sequence[tuple[ShiftPoint, Weights]], split: str | None = "train",
                 seed: int = 0, total: int | None = None) -> PromptMix:
        """A mix given as its whole schedule, [(0, weights), (at, weights), ...]."""
        if not phases or phases[0][0] != 0:
            raise ValueError("a schedule starts at 0: [(0, weights), (at, weights), ...]")
        return cls(phases[0][1], split, seed, list(phases[1:]), total)

    def weights_at(self, n: int) -> dict[str, float]:
        """The weights that choose the domain of prompt number n (0-based)."""
        return dict(next(w for start, w in reversed(self.phases) if start <= n))

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        weights = self.weights_at(self.drawn)
        names = [d for d, w in weights.items() if w > 0]
        domain = self._rng.choices(names, weights=[weights[d] for d in names])[0]
        queue = self._queues[domain]
        if not queue:
            queue.extend(self._rng.sample(self._pools[domain], len(self._pools[domain])))
        self.drawn += 1
        return queue.pop()

    next = __next__


def _phases(entries: Sequence[tuple[ShiftPoint, Weights]], total: int | None) -> list[tuple[int, dict[str, float]]]:
    phases: list[tuple[int, dict[str, float]]] = []
    for at, weights in entries:
        start = _position(at, total)
        if phases and start <= phases[-1][0]:
            raise ValueError(f"shift points must increase: {at!r} comes at prompt {start}, "
                             f"not after prompt {phases[-1][0]}")
        phases.append((start, _check_weights(weights)))
    return phases


def _position(at: ShiftPoint, total: int | None) -> int:
    if isinstance(at, int) and not isinstance(at, bool) and at >= 0:
        return at
    if isinstance(at, float) and 0.0 <= at <= 1.0:
        if not isinstance(total, int) or total <= 0:
            raise ValueError(f"shift point {at} is a fraction; pass total=<number of prompts> with it")
        return round(at * total)
    raise ValueError(f"a shift point is a prompt count (int >= 0) or a fraction of total (float in [0, 1]); "
                     f"got {at!r}")


def _check_weights(weights: Weights) -> dict[str, float]:
    for domain in weights:
        _check_name("domain", domain, DOMAINS)
    values = {d: weights[d] for d in DOMAINS if d in weights}
    valid = all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                for w in values.values())
    if not valid or sum(values.values()) <= 0:
        raise ValueError(f"weights must be finite, >= 0, and not all 0; got {dict(weights)}")
    return values
