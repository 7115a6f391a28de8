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
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

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

_Draft = tuple[str, Fraction | None, dict[str, Any]]       # text, answer, slots


@dataclass(frozen=True)
class _Group:
    """One list of topics and how to write one prompt about a topic."""

    topics: tuple[str, ...]
    write: Callable[[random.Random, str], _Draft]
    per_topic: int


def _groups(domain: str) -> tuple[_Group, ...]:
    return {
        "code": (
            _Group(_FUNCTION_TASKS, _fill(_FUNCTION_TEMPLATES, _FUNCTION_EXTRAS,
                                          kind=("write",), lang=("Python", "JavaScript")), 8),
            _Group(_SQL_TASKS, _fill(_SQL_TEMPLATES, _SQL_EXTRAS, kind=("write",), lang=("SQL",)), 6),
            _Group(_BASH_TASKS, _fill(_BASH_TEMPLATES, _BASH_EXTRAS, kind=("write",), lang=("bash",)), 6),
            _Group(tuple(_SNIPPETS), _write_snippet, 3),
        ),
        "math": (_Group(tuple(_MATH), lambda rng, topic: _MATH[topic](rng), 15),),
        "chat": tuple(_Group(topics, _fill(templates, _CHAT_EXTRAS[kind], kind=(kind,)), 3)
                      for kind, (topics, templates) in _CHAT.items()),
        "structured": (_Group(tuple(_RECORDS), _write_structured, 14),),
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
    lang, code, purpose = _SNIPPETS[name]
    kind = "fix" if purpose and rng.random() < 0.6 else "explain"
    ask = rng.choice(_SNIPPET_TEMPLATES[kind]).format(lang=lang, purpose=purpose)
    code = rng.choice((f"```{lang.lower()}\n{code}\n```", f"```\n{code}\n```", code))   # fenced, or pasted bare
    return f"{ask}\n\n{code}", None, {"kind": kind, "lang": lang}


def _write_structured(rng: random.Random, plural: str) -> _Draft:
    one, fields = _RECORDS[plural]
    fmt = rng.choice(tuple(_FORMATS))
    picked = [fields[i] for i in sorted(rng.sample(range(len(fields)), rng.randint(3, min(5, len(fields)))))]
    n = rng.randint(3, 8)
    text = rng.choice(_FORMATS[fmt]).format(one=one, many=plural, n=n, fields=_join(picked),
                                            cols=", ".join(picked))
    extra = rng.choice(_STRUCTURED_EXTRAS + _FORMAT_EXTRAS.get(fmt, ()))
    return _sentences(text, extra), None, {"format": fmt, "fields": tuple(picked), "n": n}


def _sentences(*parts: str) -> str:
    text = " ".join(p for p in parts if p)
    return text[0].upper() + text[1:]


def heldout_topics(topics: Sequence[str]) -> set[str]:
    """The held-out rule: the HELDOUT_FRACTION of a list's topics that sort first by crc32."""
    n = max(1, round(HELDOUT_FRACTION * len(topics)))
    return set(sorted(topics, key=lambda t: (zlib.crc32(t.encode()), t))[:n])


def format_number(x: Fraction) -> str:
    """The canonical form of a math answer: "42", "-3", "12.5" (exact; at most two decimals)."""
    if (x * 100).denominator != 1:
        raise ValueError(f"{x} has more than two decimals")
    whole, cents = divmod(abs(x.numerator * 100 // x.denominator), 100)
    sign = "-" if x < 0 else ""
    return f"{sign}{whole}" if cents == 0 else f"{sign}{whole}.{cents:02d}".rstrip("0")


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


# ---- code ------------------------------------------------------------------------------------------

_FUNCTION_TASKS = (
    "reverses the order of the words in a sentence",
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "returns the n-th Fibonacci number",
    "checks whether a number is prime",
    "counts how many times each word appears in a piece of text",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the original order",
    "flattens a nested list of any depth",
    "converts a temperature from Celsius to Fahrenheit",
    "finds the second largest number in a list",
    "groups a list of words by their first letter",
    "checks whether an email address looks valid using a simple regular expression",
    "turns a title like \"Hello World!\" into a URL slug like \"hello-world\"",
    "splits a list into chunks of size n",
    "returns the most common character in a string",
    "checks whether two strings are anagrams of each other",
    "converts a Roman numeral to an integer",
    "rotates a list to the right by k positions",
    "computes the factorial of n without recursion",
    "finds all pairs of numbers in a list that add up to a target",
    "capitalizes the first letter of every word in a string",
    "parses a URL query string into key/value pairs",
    "formats a number of seconds as HH:MM:SS",
    "computes the greatest common divisor of two integers",
    "transposes a matrix given as a list of rows",
    "recursively merges two nested dictionaries",
    "counts the vowels in a string",
    "returns the items two lists have in common, without duplicates",
    "generates a random password of a given length from letters and digits",
    "checks whether the brackets in a string are balanced",
    "does a binary search on a sorted list and returns the index, or -1 if the value is missing",
    "splits a CSV line into fields, keeping commas inside quotes",
    "computes the Levenshtein distance between two strings",
    "finds the longest common prefix of a list of strings",
    "retries another function up to three times with exponential backoff",
    "returns the number of days between two dates",
    "compresses a string like \"aaabcc\" into \"a3b1c2\"",
    "returns the k largest numbers in a list",
    "checks whether a year is a leap year",
    "masks all but the last four digits of a credit card number",
    "converts a snake_case string to camelCase",
    "adds up the digits of an integer",
    "sorts a list of people by age, and by name when the ages are equal",
    "reads a text file and returns its lines without trailing whitespace",
    "converts a decimal number to its binary representation as a string",
)
_FUNCTION_TEMPLATES = (
    "Write a {lang} function that {x}.",
    "Can you write a {lang} function that {x}?",
    "I need a {lang} function that {x}.",
    "How would you write a function in {lang} that {x}?",
    "Show me a short {lang} function that {x}.",
    "What's the cleanest way to write a {lang} function that {x}?",
)
_FUNCTION_EXTRAS = (
    "", "", "Add a short comment explaining how it works.", "Please include a couple of example calls.",
    "Keep it short and don't use any external libraries.", "Also tell me its time complexity.",
    "Make sure it handles edge cases.", "I'm a beginner, so keep it readable.",
)

_SQL_TASKS = (
    "finds the top 5 customers by total order amount in an orders table",
    "counts how many employees work in each department",
    "returns the users who signed up in the last 30 days",
    "finds email addresses that appear more than once in a users table",
    "lists the products that have never been ordered",
    "shows the average salary for each job title, highest first",
    "gets the second highest salary from an employees table",
    "shows total revenue per month for the current year",
    "deletes rows older than 90 days from a logs table",
    "lists every order together with the name of the customer who placed it",
    "finds customers who have placed more than three orders",
    "ranks students by score within each class",
    "returns the most recent order for every customer",
    "calculates a running total of daily sales",
)
_SQL_TEMPLATES = (
    "Write a SQL query that {x}.", "Can you give me a SQL query that {x}?",
    "I'm using PostgreSQL. Write a query that {x}.", "Using SQLite, how do I write a query that {x}?",
    "What would a SQL query look like that {x}?",
)
_SQL_EXTRAS = ("", "", "Please explain each clause briefly.", "Assume sensible table and column names.",
               "Keep it to a single query if you can.")

_BASH_TASKS = (
    "finds all .log files larger than 100 MB under /var/log",
    "renames every .jpeg file in a folder to .jpg",
    "counts the lines in all the Python files of a project",
    "prints the 10 largest files under the current directory",
    "deletes files older than 7 days from a temp folder",
    "checks whether a website returns HTTP 200 and prints a warning if it doesn't",
    "backs up a directory into a .tar.gz archive with today's date in the name",
    "pings each host in a list once and reports which ones are down",
    "replaces one word with another in every .txt file in a folder",
    "prints the unique IP addresses found in a web server access log",
    "waits until a TCP port is open before continuing",
    "shows how much disk space each subfolder uses, largest first",
)
_BASH_TEMPLATES = (
    "Write a bash script that {x}.", "Give me a bash one-liner that {x}.", "What's a shell command that {x}?",
    "I need a bash script that {x}. It has to work on both Linux and macOS.",
    "How do I write a small bash script that {x}?",
)
_BASH_EXTRAS = ("", "", "Please explain what each part does.", "Make it safe to run twice.",
                "Keep it short.")

# name -> (language, code, what it should do if it has a bug, else None)
_SNIPPETS: dict[str, tuple[str, str, str | None]] = {
    "python mutable default": ("Python", "def add_item(item, items=[]):\n    items.append(item)\n    return items",
                               "return a new one-item list whenever it's called without a list"),
    "python off by one": ("Python", "def sum_to(n):\n    total = 0\n    for i in range(n):\n        total += i\n"
                          "    return total", "add up the numbers from 1 to n"),
    "python remove while iterating": ("Python", "def remove_evens(nums):\n    for n in nums:\n"
                                      "        if n % 2 == 0:\n            nums.remove(n)\n    return nums",
                                      "remove every even number from the list"),
    "python input is a string": ("Python", "age = input(\"Age: \")\nif age >= 18:\n    print(\"adult\")",
                                 "print \"adult\" when the user is 18 or older"),
    "python late binding": ("Python", "funcs = [lambda: i for i in range(3)]\nprint([f() for f in funcs])",
                            "print [0, 1, 2]"),
    "python dict comprehension": ("Python", "squares = {n: n * n for n in range(10) if n % 2}", None),
    "python timing decorator": ("Python", "def timed(fn):\n    def wrapper(*args, **kwargs):\n"
                                "        start = time.perf_counter()\n        result = fn(*args, **kwargs)\n"
                                "        print(fn.__name__, time.perf_counter() - start)\n        return result\n"
                                "    return wrapper", None),
    "js var in loop": ("JavaScript", "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 100);\n}",
                       "log 0, 1 and 2"),
    "js default sort": ("JavaScript", "const sorted = [10, 1, 5, 100].sort();\nconsole.log(sorted);",
                        "sort the numbers from smallest to largest"),
    "js async foreach": ("JavaScript", "async function total(ids) {\n  let sum = 0;\n  ids.forEach(async (id) => {\n"
                         "    sum += await fetchPrice(id);\n  });\n  return sum;\n}",
                         "add up the prices for all the ids"),
    "js set spread": ("JavaScript", "const unique = [...new Set(items)];", None),
    "js reduce cart": ("JavaScript", "const total = cart.reduce((sum, item) => sum + item.price * item.qty, 0);",
                       None),
    "js debounce": ("JavaScript", "function debounce(fn, ms) {\n  let timer;\n  return (...args) => {\n"
                    "    clearTimeout(timer);\n    timer = setTimeout(() => fn(...args), ms);\n  };\n}", None),
    "sql where aggregate": ("SQL", "SELECT department, COUNT(*)\nFROM employees\nWHERE COUNT(*) > 10\n"
                            "GROUP BY department;", "list the departments with more than 10 employees"),
    "sql equals null": ("SQL", "SELECT * FROM users WHERE email = NULL;", "find the users who have no email"),
    "sql window rank": ("SQL", "SELECT name, salary,\n"
                        "       RANK() OVER (PARTITION BY dept ORDER BY salary DESC) AS r\nFROM employees;", None),
    "sql anti join": ("SQL", "SELECT c.name\nFROM customers c\nLEFT JOIN orders o ON o.customer_id = c.id\n"
                      "WHERE o.id IS NULL;", None),
    "bash ls loop": ("Bash", "for f in $(ls *.txt); do\n  mv $f backup/$f\ndone",
                     "move every .txt file into backup/, even when the name has spaces"),
    "bash find xargs": ("Bash", "find . -name \"*.py\" -print0 | xargs -0 grep -l \"TODO\"", None),
    "bash dated tar": ("Bash", "tar -czf \"backup-$(date +%F).tar.gz\" ~/notes", None),
}
_SNIPPET_TEMPLATES = {
    "explain": ("Explain what this {lang} snippet does:", "What does this {lang} code do?",
                "Can you walk me through this {lang} code line by line?",
                "I found this {lang} code in our repo. What is it for?"),
    "fix": ("Fix the bug in this {lang} code. It should {purpose}.",
            "This {lang} code is supposed to {purpose}, but it doesn't. What's wrong?",
            "Why doesn't this work? I want it to {purpose}.",
            "Can you find the bug? This should {purpose}, and I'm stuck."),
}


# ---- math: each topic is a kind of problem; its writer draws numbers and computes the answer -------

_NAMES = ("Maya", "Liam", "Aisha", "Carlos", "Yuki", "Noah", "Priya", "Omar", "Elena", "Sam", "Grace", "Tomas",
          "Zara", "Ben", "Mei", "Diego", "Hannah", "Kofi", "Lena", "Ravi")
_GOODS = (("notebook", "notebooks"), ("coffee", "coffees"), ("movie ticket", "movie tickets"),
          ("bag of apples", "bags of apples"), ("pen", "pens"), ("sandwich", "sandwiches"),
          ("bus pass", "bus passes"), ("box of tea", "boxes of tea"), ("plant pot", "plant pots"))
_PRICED = ("jacket", "pair of headphones", "lamp", "backpack", "desk chair", "blender", "pair of boots",
           "coffee maker", "bike helmet")


def _pick(rng: random.Random, *templates: str, **slots: Any) -> str:
    return rng.choice(templates).format(**slots)


def _money(x: Fraction) -> str:
    return f"${x.numerator // x.denominator}" if x.denominator == 1 else f"${float(x):.2f}"


def _join(items: Sequence[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _clock(minutes: int) -> str:
    h, m = divmod(minutes, 60)
    return f"{(h - 1) % 12 + 1}:{m:02d} {'am' if h < 12 else 'pm'}"


def _expression(rng: random.Random, expr: str, value: int, *words: str, shown: bool = True) -> _Draft:
    """An arithmetic question: a phrasing in words, or the expression itself when people write it so."""
    plain = ("What is {e}?", "Compute {e}.", "What's {e}? Just the number, please.", "Can you work out {e} for me?")
    text = rng.choice((plain if shown else ()) + words).format(e=expr)
    return text, Fraction(value), {"expr": expr}


def _add(rng):
    a, b = rng.randint(12, 9999), rng.randint(12, 9999)
    return _expression(rng, f"{a} + {b}", a + b, f"Add {a} and {b}.")


def _subtract(rng):
    a, b = sorted((rng.randint(12, 9999), rng.randint(12, 9999)), reverse=True)
    return _expression(rng, f"{a} - {b}", a - b, f"Subtract {b} from {a}.")


def _multiply(rng):
    a, b = rng.randint(12, 999), rng.randint(3, 99)
    return _expression(rng, f"{a} * {b}", a * b, f"What's {a} times {b}?", f"Multiply {a} by {b}.")


def _divide(rng):
    b, q = rng.randint(3, 40), rng.randint(12, 400)
    return _expression(rng, f"{b * q} / {b}", q, f"What is {b * q} divided by {b}?")


def _order_of_operations(rng):
    a, b, c, d = (rng.randint(2, 20) for _ in range(4))
    expr, value = rng.choice(((f"{a} + {b} * {c}", a + b * c), (f"({a} + {b}) * {c} - {d}", (a + b) * c - d),
                              (f"{a} * {b} - {c} * {d}", a * b - c * d), (f"{a} + {b} * ({c} - {d})", a + b * (c - d))))
    return _expression(rng, expr, value, f"Evaluate {expr}, following the order of operations.")


def _power(rng):
    b = rng.randint(2, 12)
    e = rng.randint(2, 6 if b <= 5 else 4)
    return _expression(rng, f"{b} ** {e}", b ** e, f"What is {b} to the power of {e}?", f"What's {b}^{e}?",
                       f"Calculate {b} raised to the power {e}.", shown=False)


def _remainder(rng):
    a, b = rng.randint(100, 9999), rng.randint(3, 50)
    return _expression(rng, f"{a} % {b}", a % b, f"What is the remainder when {a} is divided by {b}?",
                       f"What's left over when you divide {a} by {b}?", shown=False)


def _percent_of(rng):
    p, n = rng.choice((5, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75, 80, 150)), rng.randrange(20, 2001, 10)
    return _pick(rng, "What is {p}% of {n}?", "Calculate {p} percent of {n}.", "How much is {p}% of {n}?",
                 p=p, n=n), Fraction(p * n, 100), {"p": p, "n": n}


def _fraction_of(rng):
    d = rng.randint(3, 12)
    n, x = rng.randint(1, d - 1), d * rng.randint(2, 60)
    return _pick(rng, "What is {n}/{d} of {x}?", "How much is {n}/{d} of {x}?", n=n, d=d, x=x), \
        Fraction(n * x, d), {"n": n, "d": d, "x": x}


def _discount(rng):
    price, p, item = Fraction(rng.randint(10, 400)), rng.choice((10, 15, 20, 25, 30, 40, 50)), rng.choice(_PRICED)
    return _pick(rng, "A {item} costs {m}. It's on sale for {p}% off. What's the sale price in dollars?",
                 "How much does a {m} {item} cost after a {p}% discount?", item=item, m=_money(price), p=p), \
        price * (100 - p) / 100, {"price": price, "p": p}


def _total_cost(rng):
    name, (one, many), q, price = rng.choice(_NAMES), rng.choice(_GOODS), rng.randint(2, 12), \
        Fraction(rng.randrange(50, 1501, 25), 100)
    return _pick(rng, "{name} buys {q} {many} at {m} each. How much does {name} spend in total, in dollars?",
                 "If one {one} costs {m}, how much do {q} of them cost?", name=name, q=q, one=one, many=many,
                 m=_money(price)), q * price, {"q": q, "price": price}


def _change(rng):
    name, (_, many), q, price = rng.choice(_NAMES), rng.choice(_GOODS), rng.randint(2, 6), \
        Fraction(rng.randrange(50, 801, 25), 100)
    bill = next(b for b in (20, 50, 100) if b > q * price)
    return _pick(rng, "{name} buys {q} {many} for {m} each and pays with a ${bill} bill. "
                 "How much change should {name} get back?", name=name, q=q, many=many, m=_money(price),
                 bill=bill), bill - q * price, {"bill": bill, "q": q, "price": price}


def _unit_price(rng):
    q, total = rng.choice((4, 6, 8, 10, 12, 24)), Fraction(rng.randrange(200, 3001, 10), 100)
    return _pick(rng, "A {q}-pack of sparkling water costs {m}. What's the price per can, in dollars?",
                 "If {q} muffins cost {m} altogether, how much is one muffin?", q=q, m=_money(total)), \
        total / q, {"q": q, "total": total}


def _split_bill(rng):
    bill, p, (n, people) = rng.randint(20, 300), rng.choice((10, 15, 20)), rng.choice(((2, "Two"), (4, "Four"),
                                                                                     (5, "Five")))
    return _pick(rng, "{people} friends split a ${bill} dinner bill evenly and add a {p}% tip. "
                 "How much does each person pay?", "A ${bill} restaurant bill plus a {p}% tip is shared "
                 "equally by {n} people. What does each of them pay?", n=n, people=people, bill=bill, p=p), \
        Fraction(bill * (100 + p), 100 * n), {"bill": bill, "p": p, "n": n}


def _average(rng):
    k = rng.choice((4, 5))
    scores = [rng.randint(50, 100) for _ in range(k)]
    return _pick(rng, "What is the average of {s}?", "{name} scored {s} on {k} quizzes. What was the average score?",
                 s=_join(scores), name=rng.choice(_NAMES), k=k), Fraction(sum(scores), k), {"values": scores}


def _median(rng):
    values = rng.sample(range(1, 100), rng.choice((5, 6, 7)))
    ordered, k = sorted(values), len(values)
    median = Fraction(ordered[k // 2]) if k % 2 else Fraction(ordered[k // 2 - 1] + ordered[k // 2], 2)
    return _pick(rng, "What is the median of {s}?", "Find the median of these numbers: {s}.", s=_join(values)), \
        median, {"values": values}


def _speed(rng):
    speed, t = rng.randint(30, 120), rng.randint(2, 6)
    return _pick(rng, "A train travels {d} km in {t} hours. What is its average speed in km/h?",
                 "A car covers {d} kilometers in {t} hours at a steady speed. How fast is it going, in km/h?",
                 d=speed * t, t=t), Fraction(speed), {"d": speed * t, "t": t}


def _travel_time(rng):
    s, d = rng.choice((10, 12, 15, 20, 24, 30)), rng.randint(2, 40)
    return _pick(rng, "Riding a bike at {s} km/h, how many minutes does it take to cover {d} km?",
                 "If you cycle at a steady {s} km/h, how many minutes will a {d} km ride take?", s=s, d=d), \
        Fraction(d * 60, s), {"s": s, "d": d}


def _area(rng):
    l, w = rng.randint(3, 25), rng.randint(3, 25)
    return _pick(rng, "A room is {l} m long and {w} m wide. What is its floor area in square meters?",
                 "What's the area of a rectangle that is {l} cm by {w} cm?", l=l, w=w), Fraction(l * w), \
        {"l": l, "w": w}


def _fencing(rng):
    l, w = rng.randint(3, 40), rng.randint(3, 40)
    return _pick(rng, "How many meters of fence do I need to go all the way around a rectangular garden that "
                 "is {l} m by {w} m?", "A rectangular field is {l} m long and {w} m wide. What is its perimeter "
                 "in meters?", l=l, w=w), Fraction(2 * (l + w)), {"l": l, "w": w}


def _ages(rng):
    a, b = rng.sample(_NAMES, 2)
    young, gap, years = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 10)
    total = 2 * young + gap + 2 * years
    return _pick(rng, "{a} is {gap} years older than {b}. In {years} years, their ages will add up to {total}. "
                 "How old is {b} now?", a=a, b=b, gap=gap, years=years, total=total), Fraction(young), \
        {"gap": gap, "years": years, "total": total}


def _recipe(rng):
    s, g, t = rng.choice((2, 4, 6, 8)), rng.randrange(100, 601, 25), rng.randint(2, 12)
    ingredient = rng.choice(("flour", "sugar", "rice", "butter", "pasta", "oats"))
    return _pick(rng, "A recipe that serves {s} uses {g} grams of {i}. How many grams do I need to serve {t}?",
                 "I'm scaling a recipe from {s} servings to {t}. It calls for {g} g of {i}. How many grams should "
                 "I use?", s=s, g=g, t=t, i=ingredient), Fraction(g * t, s), {"s": s, "g": g, "t": t}


def _minutes_to_hours(rng):
    m = 15 * rng.randint(3, 40)
    return _pick(rng, "How many hours is {m} minutes?", "Convert {m} minutes to hours.", m=m), Fraction(m, 60), \
        {"m": m}


def _unit_conversion(rng):
    (small, big, factor), x = rng.choice((("meters", "kilometers", 1000), ("grams", "kilograms", 1000),
                                          ("centimeters", "meters", 100), ("milliliters", "liters", 1000))), \
        Fraction(rng.randint(5, 200), 10)
    return _pick(rng, "How many {small} are in {x} {big}?", "Convert {x} {big} to {small}.", small=small, big=big,
                 x=format_number(x)), x * factor, {"x": x, "factor": factor}


def _simple_interest(rng):
    p, r, y = rng.randrange(500, 20001, 100), rng.choice((2, 3, 4, 5, 6)), rng.randint(1, 10)
    return _pick(rng, "If you put ${p} in an account that pays {r}% simple interest per year, how much interest "
                 "do you earn in {y} years?", "How much simple interest does ${p} earn at {r}% a year over "
                 "{y} years?", p=p, r=r, y=y), Fraction(p * r * y, 100), {"p": p, "r": r, "y": y}


def _ratio_share(rng):
    a, b = rng.sample(_NAMES, 2)
    x, y = rng.sample(range(1, 8), 2)
    total = (x + y) * rng.randint(5, 200)
    return _pick(rng, "{a} and {b} split ${total} in the ratio {x}:{y}. How much does {a} get?", a=a, b=b,
                 total=total, x=x, y=y), Fraction(total * x, x + y), {"total": total, "x": x, "y": y}


def _overtime(rng):
    name, w, h = rng.choice(_NAMES), rng.randint(12, 40), rng.randint(41, 60)
    return _pick(rng, "{name} earns ${w} an hour, plus time and a half for every hour over 40. How much does "
                 "{name} earn in a {h}-hour week?", name=name, w=w, h=h), \
        Fraction(40 * w) + Fraction(3, 2) * w * (h - 40), {"w": w, "h": h}


def _consecutive(rng):
    middle = rng.randint(5, 300)
    return _pick(rng, "The sum of three consecutive integers is {s}. What is the largest of the three?",
                 "Three consecutive whole numbers add up to {s}. What's the biggest one?", s=3 * middle), \
        Fraction(middle + 1), {"s": 3 * middle}


def _gcd(rng):
    g = rng.randint(2, 30)
    a, b = g * rng.randint(2, 20), g * rng.randint(2, 20)
    return _pick(rng, "What is the greatest common divisor of {a} and {b}?", "Find the GCD of {a} and {b}.",
                 a=a, b=b), Fraction(math.gcd(a, b)), {"a": a, "b": b}


def _lcm(rng):
    a, b = rng.randint(4, 60), rng.randint(4, 60)
    return _pick(rng, "What is the least common multiple of {a} and {b}?", "Find the LCM of {a} and {b}.",
                 a=a, b=b), Fraction(math.lcm(a, b)), {"a": a, "b": b}


def _elapsed(rng):
    start = rng.randrange(7 * 60, 12 * 60, 5)
    end = start + rng.randrange(20, 6 * 60, 5)
    return _pick(rng, "A meeting starts at {s} and ends at {e}. How many minutes long is it?",
                 "A flight leaves at {s} and lands at {e} the same day. How long is the flight in minutes?",
                 s=_clock(start), e=_clock(end)), Fraction(end - start), {"start": start, "end": end}


def _handshakes(rng):
    n = rng.randint(4, 40)
    return _pick(rng, "At a meeting, {n} people each shake hands with everyone else exactly once. How many "
                 "handshakes are there?", "In a league of {n} teams, every team plays every other team once. "
                 "How many games is that?", n=n), Fraction(n * (n - 1) // 2), {"n": n}


def _series_sum(rng):
    n = rng.randint(10, 200)
    return _pick(rng, "What is the sum of all the whole numbers from 1 to {n}?",
                 "Add up every integer from 1 through {n}. What do you get?", n=n), Fraction(n * (n + 1) // 2), \
        {"n": n}


def _percent_change(rng):
    old, p, up = rng.randrange(20, 501, 20), rng.choice((5, 10, 20, 25, 40, 50)), rng.random() < 0.5
    new = Fraction(old * (100 + p if up else 100 - p), 100)
    return _pick(rng, "The price of a {item} went from ${old} to {new}. By what percent did it go {way}?",
                 item=rng.choice(_PRICED), old=old, new=_money(new), way="up" if up else "down"), Fraction(p), \
        {"old": old, "new": new}


def _reading_pace(rng):
    name, d, k = rng.choice(_NAMES), rng.randint(3, 30), rng.randint(5, 60)
    return _pick(rng, "{name} wants to finish a {p}-page book in {d} days. How many pages a day is that?",
                 name=name, p=d * k, d=d), Fraction(k), {"p": d * k, "d": d}


def _fuel(rng):
    rate, d = Fraction(rng.randint(9, 18), 2), rng.randrange(50, 901, 10)
    return _pick(rng, "A car uses {r} liters of fuel per 100 km. How many liters does it need for a {d} km trip?",
                 r=format_number(rate), d=d), rate * d / 100, {"rate": rate, "d": d}


def _savings(rng):
    name, s, w = rng.choice(_NAMES), rng.randrange(5, 101, 5), rng.randint(3, 52)
    return _pick(rng, "{name} saves ${s} every week. How many weeks will it take to save ${goal}?",
                 "If I put away ${s} a week, how many weeks until I have ${goal}?", name=name, s=s, goal=s * w), \
        Fraction(w), {"s": s, "goal": s * w}


_MATH: dict[str, Callable[[random.Random], _Draft]] = {
    "add": _add, "subtract": _subtract, "multiply": _multiply, "divide": _divide,
    "order of operations": _order_of_operations, "power": _power, "remainder": _remainder,
    "percent of": _percent_of, "fraction of": _fraction_of, "discount": _discount, "total cost": _total_cost,
    "change": _change, "unit price": _unit_price, "split bill": _split_bill, "average": _average,
    "median": _median, "speed": _speed, "travel time": _travel_time, "area": _area, "fencing": _fencing,
    "ages": _ages, "recipe": _recipe, "minutes to hours": _minutes_to_hours, "unit conversion": _unit_conversion,
    "simple interest": _simple_interest, "ratio share": _ratio_share, "overtime": _overtime,
    "consecutive integers": _consecutive, "gcd": _gcd, "lcm": _lcm, "elapsed time": _elapsed,
    "handshakes": _handshakes, "series sum": _series_sum, "percent change": _percent_change,
    "reading pace": _reading_pace, "fuel": _fuel, "savings": _savings,
}


# ---- chat: kind -> (topics, templates); a comparison topic is "a|b" ------------------------------------

_CHAT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "explain": ((
        "photosynthesis", "the immune system", "GPS", "a credit score", "compound interest", "inflation",
        "noise cancellation in headphones", "a refrigerator", "the stock market", "the electoral college", "a mortgage",
        "the greenhouse effect", "a heat pump", "the placebo effect", "natural selection", "plate tectonics",
        "a blockchain", "a nuclear power plant", "the water cycle", "a jet engine", "long-term memory",
        "an mRNA vaccine", "a solar panel", "the tide", "an electric car battery", "the Federal Reserve",
        "a search engine", "a microwave oven", "a rainbow", "carbon dating", "a 3D printer", "daylight saving time",
        "the human heart", "an index fund", "the cycle of the seasons", "a touchscreen", "the aurora borealis",
        "insulin",
        "public-key cryptography", "a hydroelectric dam",
    ), (
        "Can you explain how {x} works?", "How does {x} actually work?", "Explain {x} in simple terms.",
        "I've never really understood {x}. Could you explain it?", "Give me a short explanation of {x}.",
        "What's the basic idea behind {x}?",
    )),
    "advice": ((
        "learning to play the guitar", "training for a first 5k", "keeping houseplants alive",
        "negotiating a salary", "studying for exams", "saving money on groceries", "sleeping better",
        "speaking in public", "writing a cover letter", "learning a new language as an adult",
        "cooking rice on the stove",
        "starting a vegetable garden", "staying focused while working from home", "preparing for a job interview",
        "traveling on a budget", "making friends in a new city", "running a good meeting",
        "taking better photos with a phone", "giving feedback to a coworker", "house-training a puppy",
        "cutting down on screen time", "brewing good coffee at home", "buying a used car", "moving to a new apartment",
        "learning to swim as an adult", "keeping a journal", "baking bread for the first time",
        "meal prepping for the week", "paying off credit card debt", "getting back into exercise after a break",
    ), (
        "Any tips for {x}?", "I want to get better at {x}. Where should I start?",
        "What are some common mistakes people make when {x}?", "How should a beginner approach {x}?",
        "Give me a few practical tips for {x}.", "What's your best advice for {x}?",
    )),
    "define": ((
        "opportunity cost", "entropy", "dramatic irony", "cognitive dissonance", "a recession", "latency",
        "biodiversity", "confirmation bias", "a carbon footprint", "gerrymandering", "osmosis", "the Doppler effect",
        "stoicism", "a filibuster", "umami", "impostor syndrome", "net neutrality", "a tariff", "a dividend",
        "herd immunity", "supply and demand", "half-life", "the sunk cost fallacy", "a circadian rhythm",
        "a haiku", "an allele", "a hedge fund", "the butterfly effect", "a food desert", "an ecosystem",
    ), (
        "What does \"{x}\" mean?", "What is meant by {x}?", "Can you define {x} and give an example?",
        "I keep hearing about {x}. What is it?", "Explain the term \"{x}\" in a sentence or two.",
        "What's a simple definition of {x}?",
    )),
    "compare": ((
        "weather|climate", "a virus|a bacterium", "stocks|bonds", "a crocodile|an alligator",
        "baking soda|baking powder", "a hurricane|a tornado", "empathy|sympathy", "a Roth IRA|a traditional IRA",
        "RAM|storage", "a latte|a cappuccino", "an asteroid|a comet", "a psychologist|a psychiatrist",
        "affect|effect", "a lake|a pond", "mass|weight", "speed|velocity", "an ETF|a mutual fund",
        "a simile|a metaphor", "LED bulbs|incandescent bulbs", "a credit card|a debit card", "renting|buying a home",
        "a frog|a toad", "Wi-Fi|Bluetooth", "a sprain|a strain", "an ale|a lager", "nuclear fission|nuclear fusion",
        "a will|a trust", "a cold|the flu", "a democracy|a republic", "an LLC|a sole proprietorship",
    ), (
        "What's the difference between {a} and {b}?", "How is {a} different from {b}?",
        "{a} versus {b}: how do they differ?", "Can you compare {a} and {b}?",
        "I always mix up {a} and {b}. How can I tell them apart?",
    )),
    "history": ((
        "the fall of the Berlin Wall", "the French Revolution", "the Apollo 11 moon landing",
        "the invention of the printing press", "the Black Death", "the Industrial Revolution",
        "the building of the Panama Canal", "the Cuban Missile Crisis", "the signing of the Magna Carta",
        "the fall of the Western Roman Empire", "the Meiji Restoration", "the decline of the Silk Road",
        "the Great Depression", "the partition of India", "the Protestant Reformation",
        "the Wright brothers' first flight", "the discovery of penicillin", "the Marshall Plan",
        "the end of apartheid in South Africa", "the Columbian Exchange",
    ), (
        "What led to {x}?", "Give me a short overview of {x}.", "Why was {x} so important?",
        "What were the main consequences of {x}?", "Summarize {x} in a few sentences.",
        "I'm reading about {x}. What should I know?",
    )),
}
_CHAT_COMMON = ("", "", "Keep it short.", "Explain it like I'm 12.", "A few bullet points are fine.",
                "I'm studying for an exam, so be precise.")
_CHAT_EXTRAS = {
    "explain": _CHAT_COMMON + ("Use an everyday analogy if you can.", "I have a science background, so you can be "
                               "a bit technical."),
    "advice": ("", "", "I only have about 30 minutes a day.", "I'm a complete beginner.", "Keep the list short.",
               "I'm on a tight budget."),
    "define": _CHAT_COMMON + ("Where does the term come from?",),
    "compare": _CHAT_COMMON + ("A small table would help.",),
    "history": _CHAT_COMMON + ("Include the key dates.",),
}


# ---- structured: plural -> (one, fields); format -> templates ------------------------------------------

_RECORDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "books": ("a book", ("title", "author", "year published", "genre", "page count")),
    "employees": ("an employee", ("name", "department", "start date", "salary", "manager")),
    "recipes": ("a recipe", ("name", "servings", "prep time", "ingredients", "steps")),
    "products": ("a product", ("name", "SKU", "price", "stock count", "category")),
    "cities": ("a city", ("name", "country", "population", "time zone", "year founded")),
    "movies": ("a movie", ("title", "director", "release year", "runtime in minutes", "rating")),
    "planets": ("a planet", ("name", "distance from the sun", "number of moons", "diameter", "rings")),
    "laptops": ("a laptop", ("brand", "model", "CPU", "RAM", "storage", "price")),
    "restaurants": ("a restaurant", ("name", "cuisine", "address", "price range", "rating")),
    "flights": ("a flight", ("flight number", "origin", "destination", "departure time", "gate")),
    "students": ("a student", ("name", "student ID", "grade", "email", "major")),
    "exercises": ("an exercise", ("name", "sets", "reps", "rest in seconds", "muscle group")),
    "events": ("an event", ("title", "date", "location", "organizer", "capacity")),
    "songs": ("a song", ("title", "artist", "album", "duration", "release year")),
    "pets": ("a pet", ("name", "species", "breed", "age", "vaccinated")),
    "job postings": ("a job posting", ("title", "company", "location", "salary range", "remote")),
    "hotels": ("a hotel", ("name", "city", "star rating", "nightly rate", "amenities")),
    "used cars": ("a used car", ("make", "model", "year", "mileage", "price")),
    "countries": ("a country", ("name", "capital", "currency", "official languages", "population")),
    "support tickets": ("a support ticket", ("ticket ID", "customer", "priority", "status", "created at")),
    "conference talks": ("a conference talk", ("speaker", "title", "track", "room", "start time")),
    "houseplants": ("a houseplant", ("common name", "Latin name", "light needs", "watering schedule", "pet-friendly")),
    "bank transactions": ("a bank transaction", ("date", "description", "amount", "category", "balance")),
    "podcast episodes": ("a podcast episode", ("show", "episode number", "title", "guest", "length")),
    "university courses": ("a university course", ("course code", "title", "instructor", "credits", "schedule")),
    "board games": ("a board game", ("name", "number of players", "play time", "minimum age", "publisher")),
    "servers": ("a server", ("hostname", "IP address", "operating system", "CPU cores", "memory")),
    "user accounts": ("a user account", ("username", "email", "role", "created at", "active")),
    "invoice lines": ("an invoice line", ("item", "quantity", "unit price", "tax rate", "total")),
    "museums": ("a museum", ("name", "city", "year founded", "famous works", "ticket price")),
    "hiking trails": ("a hiking trail", ("name", "length in km", "elevation gain", "difficulty", "region")),
    "coffee orders": ("a coffee order", ("customer name", "drink", "size", "milk", "extra shots")),
    "sports teams": ("a sports team", ("name", "city", "league", "year founded", "home stadium")),
    "smartphones": ("a smartphone", ("brand", "model", "screen size", "battery capacity", "price")),
}
_FORMATS = {
    "json": ("Give me a JSON object for {one} with the fields {fields}.",
             "Create a sample JSON record for {one} with these keys: {cols}.",
             "Generate a JSON array of {n} {many}, each with {fields}."),
    "yaml": ("Write a YAML file that lists {n} {many} with {fields} for each.",
             "Show me {one} as YAML with the keys {cols}."),
    "csv": ("Make a CSV with a header row and {n} rows of made-up {many}. Columns: {cols}.",
            "Give me sample CSV data for {n} {many} ({cols})."),
    "markdown table": ("Create a markdown table of {n} {many} with columns for {fields}.",
                       "Put {n} example {many} in a markdown table with {fields}."),
    "list": ("List {n} {many} as bullet points, each showing {fields}.",
             "Write a numbered list of {n} {many}, giving {fields} for each one."),
}
_STRUCTURED_EXTRAS = ("", "", "Use realistic but made-up values.", "No explanation, just the output.",
                      "Keep the values short.")
_FORMAT_EXTRAS = {"json": ("Use snake_case for the keys.", "Make sure it's valid JSON."),
                  "yaml": ("Use snake_case for the keys.",), "csv": ("Quote any value that contains a comma.",)}
