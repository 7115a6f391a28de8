"""Paired tests between two policy versions answering the same items: is a rise a rise?

    mcnemar(first, second)              per item pass/fail (a prompt followed in full, or not)
    paired_bootstrap(first, second)     per item a list of pass/fail parts (a prompt's instructions), the
                                        statistic pooled over parts (followed instructions / instructions)

Both return the difference second - first with a 95% CI; a rise is measured when the CI lies above 0.
`bootstrap_rate(items)` is one version's pooled rate with its 95% CI, resampled the same way.
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def mcnemar(first: list[bool], second: list[bool]) -> dict:
    """McNemar's test on paired pass/fail outcomes of the same N items.

    Discordant items: b pass only with `second`, c only with `first`. diff = (b - c) / N, its 95% CI the Wald
    interval for paired proportions, diff +- 1.96 * sqrt(b + c - (b - c)^2 / N) / N; p the exact two-sided
    binomial test of b against Binomial(b + c, 1/2) (McNemar's exact test; 1.0 with no discordant item).
    """
    if len(first) != len(second) or not first:
        raise ValueError(f"mcnemar needs two equally long, non-empty lists; got {len(first)} and {len(second)}")
    n = len(first)
    b = sum(1 for x, y in zip(first, second) if y and not x)
    c = sum(1 for x, y in zip(first, second) if x and not y)
    diff = (b - c) / n
    half = Z95 * math.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n
    tail = sum(math.comb(b + c, i) for i in range(min(b, c) + 1)) / 2 ** (b + c)
    return {"first": sum(map(bool, first)) / n, "second": sum(map(bool, second)) / n, "diff": diff,
            "ci95": [diff - half, diff + half], "p_value": min(1.0, 2 * tail), "only_second": b, "only_first": c,
            "items": n, "method": "McNemar exact (binomial on discordant items); CI: Wald for paired proportions"}


def paired_bootstrap(first: list[list[bool]], second: list[list[bool]], *, iterations: int = 10_000,
                     seed: int = 0) -> dict:
    """Pooled pass rate (parts passed / parts) of `second` minus `first`, with a 95% percentile CI.

    Items (prompts) are resampled with replacement, with all their parts (instructions), the same draw for both
    versions: parts of one prompt answer to one response, so they are not independent; resampling the items keeps
    that. p: twice the smaller share of resampled differences on either side of 0, within [1 / iterations, 1].
    """
    if len(first) != len(second) or not first or any(len(x) != len(y) for x, y in zip(first, second)):
        raise ValueError("paired_bootstrap needs the same items with the same parts for both versions")
    passed_first, parts = _passed_and_parts(first)
    passed_second, _ = _passed_and_parts(second)
    draws = _resamples(len(first), iterations, seed)
    diffs = (passed_second[draws].sum(axis=1) - passed_first[draws].sum(axis=1)) / _resampled_parts(parts, draws)
    low, high = np.percentile(diffs, [2.5, 97.5])
    # resolution 1 / iterations: a p below it is reported as 1 / iterations, never as 0
    p = min(1.0, max(2 * min(float((diffs <= 0).mean()), float((diffs >= 0).mean())), 1 / iterations))
    return {"first": float(passed_first.sum() / parts.sum()), "second": float(passed_second.sum() / parts.sum()),
            "diff": float((passed_second.sum() - passed_first.sum()) / parts.sum()), "ci95": [float(low), float(high)],
            "p_value": p, "items": len(first), "parts": int(parts.sum()), "iterations": iterations,
            "method": f"paired bootstrap over items (their parts kept together), {iterations} resamples, percentile CI"}


def bootstrap_rate(items: list[list[bool]], *, iterations: int = 10_000, seed: int = 0) -> dict:
    """One version's pooled pass rate (parts passed / parts) with a 95% percentile CI, items resampled with all
    their parts (as `paired_bootstrap` does: parts of one item are not independent)."""
    if not items:
        raise ValueError("bootstrap_rate needs at least one item")
    passed, parts = _passed_and_parts(items)
    draws = _resamples(len(items), iterations, seed)
    low, high = np.percentile(passed[draws].sum(axis=1) / _resampled_parts(parts, draws), [2.5, 97.5])
    return {"rate": float(passed.sum() / parts.sum()), "ci95": [float(low), float(high)], "items": len(items),
            "parts": int(parts.sum()), "iterations": iterations,
            "method": f"bootstrap over items (their parts kept together), {iterations} resamples, percentile CI"}


def _resampled_parts(parts: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Parts in each resample, float64 [iterations]; a resample of part-less items only counts as 1 (its rate 0)."""
    total = parts[draws].sum(axis=1)
    total[total == 0] = 1.0
    return total


def _passed_and_parts(items: list[list[bool]]) -> tuple[np.ndarray, np.ndarray]:
    """Per item: parts passed, parts (float64 [N] each). ValueError when there is no part at all."""
    passed = np.array([sum(map(bool, x)) for x in items], dtype=np.float64)
    parts = np.array([len(x) for x in items], dtype=np.float64)
    if parts.sum() == 0:
        raise ValueError("a pooled rate needs at least one part")
    return passed, parts


def _resamples(items: int, iterations: int, seed: int) -> np.ndarray:
    """Item indices drawn with replacement, int64 [iterations, items] (seeded: the same draw for both versions)."""
    return np.random.default_rng(seed).integers(0, items, size=(iterations, items))
