"""Paired tests between two policy versions answering the same items: is a rise a rise?

    mcnemar(first, second)              per item pass/fail (a prompt followed in full, or not)
    paired_bootstrap(first, second)     per item a list of pass/fail parts (a prompt's instructions), the
                                        statistic pooled over parts (followed instructions / instructions)

Both return the difference second - first with a 95% CI; a rise is measured when the CI lies above 0.
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
    passed_first = np.array([sum(map(bool, x)) for x in first], dtype=np.float64)
    passed_second = np.array([sum(map(bool, y)) for y in second], dtype=np.float64)
    parts = np.array([len(x) for x in first], dtype=np.float64)
    if parts.sum() == 0:
        raise ValueError("paired_bootstrap needs at least one part")
    draws = np.random.default_rng(seed).integers(0, len(first), size=(iterations, len(first)))
    total = parts[draws].sum(axis=1)
    total[total == 0] = 1.0
    diffs = (passed_second[draws].sum(axis=1) - passed_first[draws].sum(axis=1)) / total
    low, high = np.percentile(diffs, [2.5, 97.5])
    # resolution 1 / iterations: a p below it is reported as 1 / iterations, never as 0
    p = min(1.0, max(2 * min(float((diffs <= 0).mean()), float((diffs >= 0).mean())), 1 / iterations))
    return {"first": float(passed_first.sum() / parts.sum()), "second": float(passed_second.sum() / parts.sum()),
            "diff": float((passed_second.sum() - passed_first.sum()) / parts.sum()), "ci95": [float(low), float(high)],
            "p_value": p, "items": len(first), "parts": int(parts.sum()), "iterations": iterations,
            "method": f"paired bootstrap over items (their parts kept together), {iterations} resamples, percentile CI"}
