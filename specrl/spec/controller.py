"""Chooses the draft length k of the next step (k = 0: plain decoding).

With per-position acceptance rate a, a step that drafts k tokens emits on average
E(k) = 1 + a + a^2 + ... + a^k tokens per sequence (the accepted prefix plus the recovered or
bonus token). It costs C(B, k): one drafter pass per draft token plus one target forward over
k+1 positions for each of the B sequences. The controller picks k maximising E(k) / C(B, k).

C comes from measurement: a calibration at start-up gives a prior for every (B, k), and every
observed step updates an exponential moving average for its (B, k). `a` is a moving estimate
of accepted / tried draft positions. When k = 0 wins, nobody learns whether the drafter got
better (a swap, or a context it is good at), so a probe step with k = 1 runs every
`probe_every` steps; each probe that still does not pay doubles the interval (up to
`max_probe_every`), which keeps its cost under a percent. A drafter swap resets the estimate.
Drafting must beat plain decoding by `margin` (5%): with a useless drafter every k yields the
same tokens, and a noisy, inflated k = 0 timing must not make drafting look better.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(accept_rate: float, k: int) -> float:
    """E(k) = sum_{i=0..k} a^i: tokens emitted per sequence by a step drafting k tokens."""
    return sum(accept_rate ** i for i in range(k + 1))


@dataclass
class CostModel:
    """Seconds per step by (batch size B, draft length k).

    `target[(B, T)]`: one target forward over T positions for B sequences; `draft[B]`: one
    drafter pass for B sequences. Observed whole steps override the composed prior."""

    target: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    observed: dict[tuple[int, int], float] = field(default_factory=dict)
    smoothing: float = 0.2

    def step_cost(self, batch: int, k: int) -> float:
        """Never less than the cost of drafting fewer tokens: drafting more is more work, and a
        noisy timing must not make it look cheaper."""
        return max(self._raw_cost(batch, j) for j in range(k + 1))

    def _raw_cost(self, batch: int, k: int) -> float:
        if (batch, k) in self.observed:
            return self.observed[(batch, k)]
        # k draft passes: the catch-up pass over the newly verified positions yields the first
        # draft token, then k-1 single-position passes.
        return self._interp(self.target, batch, k + 1) + k * self._interp_draft(batch)

    def observe(self, batch: int, k: int, seconds: float) -> None:
        old = self.observed.get((batch, k))
        self.observed[(batch, k)] = seconds if old is None else old + self.smoothing * (seconds - old)

    def _interp(self, table: dict[tuple[int, int], float], batch: int, t: int) -> float:
        """Linear interpolation over the calibrated batch sizes at positions t."""
        points = sorted((b, s) for (b, tt), s in table.items() if tt == t)
        if not points:
            return 1.0 + 0.6 * (t > 1) + 0.1 * t  # no calibration: a pessimistic FACTS.md-like shape
        return _interpolate(points, batch)

    def _interp_draft(self, batch: int) -> float:
        points = sorted(self.draft.items())
        return _interpolate(points, batch) if points else 0.2


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    if x <= points[0][0]:
        return points[0][1] * x / points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    x0, y0 = points[-1]
    return y0 * x / x0


class SpeculationController:
    def __init__(self, max_k: int, costs: CostModel | None = None, *, fixed_k: int | None = None,
                 initial_accept_rate: float = 0.5, decay: float = 0.9, probe_every: int = 16,
                 max_probe_every: int = 256, margin: float = 1.05):
        self.max_k = max_k
        self.margin = margin
        self.fixed_k = fixed_k  # always draft this many (benchmarks, tests); None: choose
        self.costs = costs or CostModel()
        self.initial_accept_rate = initial_accept_rate
        self.decay = decay
        self.min_probe_every, self.max_probe_every = probe_every, max_probe_every
        self.reset()

    def reset(self) -> None:
        """Forget acceptance (a new drafter was swapped in)."""
        self._accepted, self._tried = self.initial_accept_rate, 1.0
        self.probe_every = self.min_probe_every
        self._steps_since_draft = 0

    @property
    def accept_rate(self) -> float:
        return self._accepted / self._tried

    def choose(self, batch: int, cap: int) -> int:
        """Draft length for the next step of `batch` sequences; at most `cap` (context/max_tokens room)."""
        cap = min(cap, self.max_k)
        if batch == 0 or cap <= 0:
            return 0
        if self.fixed_k is not None:
            return min(self.fixed_k, cap)
        a = self.accept_rate
        rates = {k: expected_tokens(a, k) / self.costs.step_cost(batch, k) for k in range(cap + 1)}
        best = max(rates, key=rates.get)
        if rates[best] < self.margin * rates[0]:
            best = 0  # drafting must pay by a margin: noisy timings alone never make it win
        if best == 0 and self._steps_since_draft + 1 >= self.probe_every:
            return 1
        return best

    def observe(self, batch: int, k: int, seconds: float, accepted: list[int]) -> None:
        """One finished step: its k, its wall time and the accepted count of each sequence."""
        self.costs.observe(batch, k, seconds)
        if k == 0:
            self._steps_since_draft += 1
            return
        tried = sum(a + (a < k) for a in accepted)
        self._accepted = self.decay * self._accepted + sum(accepted)
        self._tried = self.decay * self._tried + tried
        if self._steps_since_draft + 1 >= self.probe_every:  # this was a probe
            pays = expected_tokens(self.accept_rate, 1) / self.costs.step_cost(batch, 1) > 1 / self.costs.step_cost(batch, 0)
            self.probe_every = self.min_probe_every if pays else min(2 * self.probe_every, self.max_probe_every)
        self._steps_since_draft = 0
