"""The project's prompt sets and the traffic mix (specrl/data/prompts.py)."""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections import Counter
from fractions import Fraction as F

import pytest
from scipy.stats import chisquare

from specrl.data import DOMAINS, SPLITS, PromptMix, as_messages, load_prompts
from specrl.data.prompts import HELDOUT_FRACTION, format_number


# ---- the prompt sets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("domain", DOMAINS)
def test_each_domain_has_enough_prompts_and_a_heldout_share(domain):
    prompts = load_prompts(domain)
    assert len(prompts) >= 400
    assert {p.domain for p in prompts} == {domain}
    heldout = sum(p.split == "heldout" for p in prompts) / len(prompts)
    assert abs(heldout - HELDOUT_FRACTION) <= 0.05


def test_split_filter_partitions_the_domain():
    for domain in DOMAINS:
        train, heldout = load_prompts(domain, "train"), load_prompts(domain, "heldout")
        assert {p.split for p in train} == {"train"} and {p.split for p in heldout} == {"heldout"}
        assert sorted(p.id for p in train + heldout) == sorted(p.id for p in load_prompts(domain))
    assert len(load_prompts()) == sum(len(load_prompts(d)) for d in DOMAINS)


def test_deterministic_across_calls_and_seeded():
    assert load_prompts() == load_prompts()
    assert [p.id for p in load_prompts(seed=3)] == [p.id for p in load_prompts(seed=3)]
    for domain in DOMAINS:
        a, b = load_prompts(domain, seed=0), load_prompts(domain, seed=1)
        assert {p.text for p in a} != {p.text for p in b}           # the seed draws other prompts ...
        assert {(p.topic, p.split) for p in a} == {(p.topic, p.split) for p in b}   # ... on the same topics


@pytest.mark.parametrize("seed", [0, 1])
def test_no_duplicates(seed):
    for domain in DOMAINS:
        texts = [p.text for p in load_prompts(domain, seed=seed)]
        assert len(texts) == len(set(texts))
    ids = [p.id for p in load_prompts(seed=seed)]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("domain", DOMAINS)
def test_heldout_topics_are_never_seen_in_train(domain):
    train = {p.topic for p in load_prompts(domain, "train")}
    heldout = {p.topic for p in load_prompts(domain, "heldout")}
    assert heldout and train
    assert not train & heldout


@pytest.mark.parametrize("domain", DOMAINS)
def test_prompts_read_like_requests(domain):
    """1-3 sentences of request (code snippets follow after a blank line), no template leftovers."""
    lengths = []
    for p in load_prompts(domain):
        request = p.text.split("\n\n")[0]
        assert request[0].isupper(), p.text
        assert request[-1] in ".?:", p.text
        assert "{" not in request and "  " not in request and "\n" not in request, p.text
        assert 1 <= len(re.findall(r"[.?!](?=\s|$)|:$", request)) <= 3, p.text
        lengths.append(len(p.text.split()))
    assert min(lengths) <= 12 and max(lengths) >= 20          # short and long prompts both occur


# ---- math answers, recomputed from the slot values (independently of the generator) ---------------------

_SOLVE = {
    "percent of": lambda s: F(s["p"] * s["n"], 100),
    "fraction of": lambda s: F(s["n"] * s["x"], s["d"]),
    "discount": lambda s: s["price"] - s["price"] * s["p"] / 100,
    "total cost": lambda s: s["q"] * s["price"],
    "change": lambda s: s["bill"] - s["q"] * s["price"],
    "unit price": lambda s: s["total"] / s["q"],
    "split bill": lambda s: F(s["bill"]) * (100 + s["p"]) / 100 / s["n"],
    "average": lambda s: F(sum(s["values"]), len(s["values"])),
    "median": lambda s: F(statistics.median(F(v) for v in s["values"])),
    "speed": lambda s: F(s["d"], s["t"]),
    "travel time": lambda s: F(s["d"], s["s"]) * 60,
    "area": lambda s: s["l"] * s["w"],
    "fencing": lambda s: s["l"] + s["w"] + s["l"] + s["w"],
    "ages": lambda s: F(s["total"] - s["gap"] - 2 * s["years"], 2),
    "recipe": lambda s: F(s["g"], s["s"]) * s["t"],
    "minutes to hours": lambda s: F(s["m"], 60),
    "unit conversion": lambda s: s["x"] * s["factor"],
    "simple interest": lambda s: F(s["p"]) * s["r"] / 100 * s["y"],
    "ratio share": lambda s: F(s["total"], s["x"] + s["y"]) * s["x"],
    "overtime": lambda s: 40 * s["w"] + (s["h"] - 40) * s["w"] * F(3, 2),
    "consecutive integers": lambda s: F(s["s"], 3) + 1,
    "gcd": lambda s: max(d for d in range(1, s["a"] + 1) if s["a"] % d == 0 and s["b"] % d == 0),
    "lcm": lambda s: next(m for m in range(s["a"], s["a"] * s["b"] + 1, s["a"]) if m % s["b"] == 0),
    "elapsed time": lambda s: s["end"] - s["start"],
    "handshakes": lambda s: math.comb(s["n"], 2),
    "series sum": lambda s: sum(range(1, s["n"] + 1)),
    "percent change": lambda s: abs(s["new"] - s["old"]) / s["old"] * 100,
    "reading pace": lambda s: F(s["p"], s["d"]),
    "fuel": lambda s: s["rate"] * s["d"] / 100,
    "savings": lambda s: F(s["goal"], s["s"]),
}


_WORDS = {"Two": 2, "Four": 4, "Five": 5}


def _expected(prompt):
    if "expr" in prompt.slots:                   # arithmetic: evaluate the expression the prompt asks about
        expr = prompt.slots["expr"]
        assert re.fullmatch(r"[\d +\-*/%()]+", expr)
        return F(eval(expr, {"__builtins__": {}}))
    return F(_SOLVE[prompt.topic](prompt.slots))


@pytest.mark.parametrize("seed", [0, 7])
def test_math_answers_are_correct(seed):
    prompts = load_prompts("math", seed=seed)
    assert {p.topic for p in prompts if "expr" not in p.slots} == set(_SOLVE)
    for p in prompts:
        assert p.answer == format_number(_expected(p)), p.text
        assert F(p.answer) == _expected(p)
        numbers = set(re.findall(r"\d+(?:\.\d+)?", p.text)) | {str(n) for w, n in _WORDS.items() if w in p.text}
        for key, value in p.slots.items():       # the values the answer uses are the ones in the text
            if key == "expr":
                assert set(re.findall(r"\d+", value)) <= numbers, p.text
            elif key not in ("start", "end", "factor") and isinstance(value, (int, F)):
                assert {format_number(F(value)), f"{float(value):.2f}"} & numbers, (key, p.text)


def test_only_math_has_answers():
    for domain in DOMAINS:
        assert all((p.answer is not None) == (domain == "math") for p in load_prompts(domain))


@pytest.mark.parametrize("value, text", [(F(42), "42"), (F(-3), "-3"), (F(25, 2), "12.5"), (F(1, 4), "0.25"),
                                         (F(-1, 20), "-0.05"), (F(0), "0"), (F(1005, 100), "10.05")])
def test_format_number(value, text):
    assert format_number(value) == text


def test_format_number_refuses_more_than_two_decimals():
    with pytest.raises(ValueError):
        format_number(F(1, 3))


# ---- the traffic mix -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mix_follows_weights(seed):
    """Chi-square goodness of fit at the 0.1% level: a correct sampler fails 1 seed in 1000."""
    weights = {"code": 5, "math": 3, "chat": 2, "structured": 0}
    n = 4000
    counts = Counter(p.domain for p in itertools.islice(PromptMix(weights, seed=seed), n))
    assert counts["structured"] == 0
    observed = [counts[d] for d in ("code", "math", "chat")]
    expected = [n * w / 10 for w in (5, 3, 2)]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_schedule_switches_at_the_stated_point():
    mix = PromptMix.schedule([(0, {"chat": 1}), (200, {"code": 1})])
    domains = [mix.next().domain for _ in range(300)]
    assert domains == ["chat"] * 200 + ["code"] * 100
    assert mix.drawn == 300
    assert mix.weights_at(199) == {"chat": 1} and mix.weights_at(200) == {"code": 1}


def test_shift_between_mixtures_and_by_fraction():
    mix = PromptMix({"chat": 1, "math": 1}, shift=[(100, {"code": 1, "structured": 1})], seed=4)
    domains = [p.domain for p in itertools.islice(mix, 200)]
    assert set(domains[:100]) == {"chat", "math"} and set(domains[100:]) == {"code", "structured"}

    mix = PromptMix({"chat": 1}, shift=[(0.25, {"math": 1}), (0.5, {"code": 1})], total=400)
    domains = [p.domain for p in itertools.islice(mix, 400)]
    assert domains == ["chat"] * 100 + ["math"] * 100 + ["code"] * 200


def test_mix_is_deterministic_and_uses_every_prompt_once_per_pass():
    def ids(**kw):
        return [p.id for p in itertools.islice(PromptMix({"chat": 1, "code": 2}, **kw), 500)]

    assert ids(seed=5) == ids(seed=5) and ids(seed=5) != ids(seed=6)
    pool = load_prompts("math", "heldout")
    drawn = list(itertools.islice(PromptMix({"math": 1}, split="heldout"), len(pool)))
    assert sorted(p.id for p in drawn) == sorted(p.id for p in pool)


def test_as_messages():
    prompt = load_prompts("chat")[0]
    assert as_messages(prompt) == [{"role": "user", "content": prompt.text}]
    assert as_messages(prompt, system="Be brief.") == [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": prompt.text}]


# ---- errors name the valid choices ---------------------------------------------------------------------

@pytest.mark.parametrize("call, names", [
    (lambda: load_prompts("poetry"), DOMAINS),
    (lambda: load_prompts("code", "test"), SPLITS),
    (lambda: PromptMix({"poetry": 1}), DOMAINS),
    (lambda: PromptMix({"chat": 1}, shift=[(10, {"poetry": 1})]), DOMAINS),
    (lambda: PromptMix({"chat": 1}, split="validation"), SPLITS),
])
def test_unknown_names_raise_value_error_listing_the_valid_ones(call, names):
    with pytest.raises(ValueError) as err:
        call()
    assert all(name in str(err.value) for name in names)


@pytest.mark.parametrize("kwargs", [
    {"weights": {"chat": -1}},
    {"weights": {"chat": 0}},
    {"weights": {}},
    {"weights": {"chat": float("nan")}},
    {"weights": {"chat": 1}, "shift": [(0, {"code": 1})]},                         # not after the start
    {"weights": {"chat": 1}, "shift": [(200, {"code": 1}), (100, {"math": 1})]},   # not increasing
    {"weights": {"chat": 1}, "shift": [(0.5, {"code": 1})]},                       # a fraction needs total
    {"weights": {"chat": 1}, "shift": [(1.5, {"code": 1})], "total": 100},
    {"weights": {"chat": 1}, "shift": [(-5, {"code": 1})]},
    {"weights": {"chat": 1}, "shift": [(True, {"code": 1})]},
])
def test_bad_mixes_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        PromptMix(**kwargs)


def test_schedule_must_start_at_zero():
    with pytest.raises(ValueError, match="starts at 0"):
        PromptMix.schedule([(100, {"chat": 1})])
