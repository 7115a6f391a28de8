"""The paired tests between two versions on the same items: McNemar's exact test and the paired bootstrap."""

from __future__ import annotations

import random

import pytest
from scipy.stats import binomtest

from specrl.trainer.significance import bootstrap_rate, mcnemar, paired_bootstrap


def test_mcnemar_counts_discordant_items_and_matches_the_exact_binomial_test():
    first = [True, True, False, False, False, True]
    second = [True, False, True, True, False, True]
    result = mcnemar(first, second)
    assert (result["only_second"], result["only_first"], result["items"]) == (2, 1, 6)
    assert result["diff"] == pytest.approx(1 / 6) and result["first"] == 0.5
    assert result["second"] == pytest.approx(4 / 6)
    rng = random.Random(0)
    for _ in range(20):
        a = [rng.random() < 0.4 for _ in range(80)]
        b = [x if rng.random() < 0.7 else rng.random() < 0.6 for x in a]
        ours = mcnemar(a, b)
        only_b, discordant = ours["only_second"], ours["only_second"] + ours["only_first"]
        expected = binomtest(only_b, discordant, 0.5).pvalue if discordant else 1.0
        assert ours["p_value"] == pytest.approx(expected)
        low, high = ours["ci95"]
        assert low <= ours["diff"] <= high


def test_mcnemar_a_clear_rise_excludes_zero_and_no_change_does_not():
    first, second = [False] * 30 + [True] * 30, [True] * 20 + [False] * 10 + [True] * 30
    rise = mcnemar(first, second)
    assert rise["diff"] == pytest.approx(20 / 60) and rise["ci95"][0] > 0 and rise["p_value"] < 1e-5
    same = mcnemar(first, first)
    assert same["diff"] == 0 and same["ci95"] == [0, 0] and same["p_value"] == 1.0
    with pytest.raises(ValueError, match="equally long"):
        mcnemar([True], [True, False])


def test_paired_bootstrap_pools_parts_and_resamples_items_together():
    first = [[True, False, False], [False], [True, True]]
    second = [[True, True, False], [True], [True, True]]
    result = paired_bootstrap(first, second, iterations=2000, seed=1)
    assert result["first"] == pytest.approx(3 / 6) and result["second"] == pytest.approx(5 / 6)
    assert result["diff"] == pytest.approx(2 / 6) and result["parts"] == 6 and result["items"] == 3
    assert result == paired_bootstrap(first, second, iterations=2000, seed=1)   # seeded
    low, high = result["ci95"]
    assert 0 <= low <= result["diff"] <= high <= 1
    same = paired_bootstrap(first, first, iterations=500)
    assert same["diff"] == 0 and same["ci95"] == [0, 0] and same["p_value"] == 1.0
    with pytest.raises(ValueError, match="same items with the same parts"):
        paired_bootstrap(first, second[:2])


def test_paired_bootstrap_finds_a_rise_of_a_third_on_two_hundred_items_and_not_noise():
    rng = random.Random(3)
    base = [[rng.random() < 0.3 for _ in range(rng.randint(1, 3))] for _ in range(200)]
    better = [[x or rng.random() < 0.5 for x in item] for item in base]
    noisy = [[rng.random() < 0.3 for _ in item] for item in base]
    assert paired_bootstrap(base, better)["ci95"][0] > 0
    low, high = paired_bootstrap(base, noisy)["ci95"]
    assert low < 0.08 and high > -0.08   # the same rate drawn again: a CI around 0, not a rise


def test_bootstrap_rate_pools_parts_and_its_ci_matches_the_binomial_one_for_single_parts():
    items = [[True, False, False], [False], [True, True]]
    result = bootstrap_rate(items, iterations=2000, seed=1)
    assert result["rate"] == pytest.approx(3 / 6) and result["parts"] == 6 and result["items"] == 3
    assert 0 <= result["ci95"][0] <= result["rate"] <= result["ci95"][1] <= 1
    rng = random.Random(5)
    single = [[rng.random() < 0.3] for _ in range(400)]     # one part per item: the binomial proportion
    rate = sum(x[0] for x in single) / len(single)
    half = 1.96 * (rate * (1 - rate) / len(single)) ** 0.5
    low, high = bootstrap_rate(single)["ci95"]
    assert (high - low) / 2 == pytest.approx(half, rel=0.1)
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_rate([])
