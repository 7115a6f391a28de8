"""Plans each verify step: which proposer drafts for each sequence, and how many tokens.

Two proposers. The learned head (EAGLE) drafts k tokens for the rows given to it, one drafter pass
per token, all its rows together. The suffix index drafts from what traffic already said, at no
cost worth counting, a different length per row with a confidence per token.

Expected tokens. A step emits accepted + 1 tokens per row. With per-position acceptance rate a, a
head draft of k tokens emits E(k) = 1 + a + a^2 + ... + a^k. A suffix draft whose tokens have
cumulative confidences c_1 >= c_2 >= ... (products of the index's vote ratios) emits
1 + sum_i min(1, s * c_i), where s calibrates confidence to live acceptance (accepted over
predicted, over recent suffix drafts).

Cost. C(B, K, h): one target forward over K+1 positions for each of the B rows (K = the longest
draft of the step; shorter rows are padded to it) plus h drafter passes when the head drafts h
tokens. A start-up calibration gives the prior for every (B, T = K+1) and drafter pass; every
observed step updates an exponential moving average for its (B, K, h).

The plan maximises expected tokens per second, sum over rows / C(B, K, h), over the verify width
K and the head's k, each row taking the better of its suffix draft (cut to K) and the head's
draft, or none. Drafting must beat plain decoding by `margin` (5%): a useless drafter yields the
same tokens, and a noisy, inflated k = 0 timing must not make drafting look better. When a
proposer is not used, nobody learns whether it got better (a swap, traffic it now knows), so
every `probe_every` steps without it a probe drafts one token with it (the head for the rows left
without a draft, the suffix index for the rows it has a draft for); each probe that still does
not pay doubles that proposer's interval (up to `max_probe_every`). A drafter swap resets the
head's estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEAD, SUFFIX, NONE = "head", "suffix", ""


def expected_tokens(accept_rate: float, k: int) -> float:
    """E(k) = sum_{i=0..k} a^i: tokens emitted per sequence by a step drafting k tokens."""
    return sum(accept_rate ** i for i in range(k + 1))


@dataclass
class CostModel:
    """Seconds per step by batch size B, verify width K (positions beyond the pending token) and
    head draft length h.

    `target[(B, T)]`: one target forward over T positions for B sequences (interpolated over B and
    T between calibrated points); `draft[B]`: one drafter pass for B sequences. Observed whole
    steps override the composed prior."""

    target: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    observed: dict[tuple[int, int, int], float] = field(default_factory=dict)
    smoothing: float = 0.2

    def step_cost(self, batch: int, width: int, head_k: int | None = None) -> float:
        """Never less than the cost of a narrower step: verifying more positions or drafting more
        is more work, and a noisy timing must not make it look cheaper. head_k None: the head
        drafts `width` tokens (a head-only step)."""
        head_k = width if head_k is None else head_k
        return max(self._raw_cost(batch, w, min(head_k, w)) for w in range(width + 1))

    def _raw_cost(self, batch: int, width: int, head_k: int) -> float:
        if (batch, width, head_k) in self.observed:
            return self.observed[(batch, width, head_k)]
        # h drafter passes: the catch-up pass over the newly verified positions yields the first
        # draft token, then h-1 single-position passes.
        return self._interp_target(batch, width + 1) + head_k * self._interp_draft(batch)

    def observe(self, batch: int, width: int, seconds: float, head_k: int | None = None) -> None:
        key = (batch, width, width if head_k is None else head_k)
        old = self.observed.get(key)
        self.observed[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def _interp_target(self, batch: int, t: int) -> float:
        """Linear interpolation over the calibrated batch sizes, then over positions."""
        ts = sorted({tt for (_, tt) in self.target})
        if not ts:
            return 1.0 + 0.6 * (t > 1) + 0.1 * t  # no calibration: pessimistic (a 2+ row forward ~1.6x one row)
        by_t = [(tt, _interpolate(sorted((b, s) for (b, t2), s in self.target.items() if t2 == tt), batch))
                for tt in ts]
        return _interpolate(by_t, t) if t not in ts else dict(by_t)[t]

    def _interp_draft(self, batch: int) -> float:
        points = sorted(self.draft.items())
        return _interpolate(points, batch) if points else 0.2


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Piecewise linear through `points` (x ascending); proportional below the first point and
    beyond the last."""
    if x <= points[0][0]:
        return points[0][1] * x / points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    x0, y0 = points[-1]
    return y0 * x / x0


@dataclass
class RowOffer:
    """What one sequence can take this step: at most `room` draft tokens (its max_tokens and
    context left), and the suffix index's draft as cumulative confidences ([] for none)."""

    room: int
    suffix: list[float] = field(default_factory=list)


@dataclass
class StepPlan:
    width: int  # K: the longest draft of the step (the verify forward covers K+1 positions per row)
    head_k: int  # tokens the head drafts for its rows (0: it does not draft)
    lengths: list[int]  # per row: draft tokens
    proposers: list[str]  # per row: HEAD, SUFFIX or NONE
    probe: bool = False  # the head drafts to learn whether it pays (not because it does)
    suffix_probe: bool = False  # the same for the suffix index

    @classmethod
    def plain(cls, batch: int) -> "StepPlan":
        return cls(0, 0, [0] * batch, [NONE] * batch)

    def rows_of(self, proposer: str) -> list[int]:
        return [b for b, p in enumerate(self.proposers) if p == proposer]


class SpeculationController:
    def __init__(self, max_k: int, costs: CostModel | None = None, *, fixed_k: int | None = None,
                 initial_accept_rate: float = 0.5, decay: float = 0.9, probe_every: int = 16,
                 max_probe_every: int = 256, margin: float = 1.05, max_suffix: int = 16):
        self.max_k, self.max_suffix = max_k, max_suffix
        self.margin = margin
        self.fixed_k = fixed_k  # the head always drafts this many (benchmarks, tests); None: choose
        self.costs = costs or CostModel()
        self.initial_accept_rate = initial_accept_rate
        self.decay = decay
        self.min_probe_every, self.max_probe_every = probe_every, max_probe_every
        self._suffix_accepted = self._suffix_predicted = 1.0  # calibration s starts at 1
        self.suffix_probe_every, self._steps_since_suffix = probe_every, 0
        self.reset()

    def reset(self) -> None:
        """Forget the head's acceptance (a new drafter was swapped in)."""
        self._accepted, self._tried = self.initial_accept_rate, 1.0
        self.probe_every = self.min_probe_every
        self._steps_since_draft = 0

    @property
    def accept_rate(self) -> float:
        """The head's per-position acceptance rate (moving estimate)."""
        return self._accepted / self._tried

    @property
    def suffix_calibration(self) -> float:
        """s: accepted suffix tokens over predicted ones (moving estimate)."""
        return self._suffix_accepted / self._suffix_predicted

    # ---- plan ---------------------------------------------------------------------------------
    def choose(self, batch: int, cap: int) -> int:
        """The head's draft length for `batch` sequences without suffix drafts, at most `cap`."""
        return self.plan([RowOffer(cap)] * batch, head=True).head_k

    def plan(self, rows: list[RowOffer], *, head: bool) -> StepPlan:
        """The step's drafts for these rows; `head`: whether a learned head is loaded."""
        batch = len(rows)
        head_cap = min([self.max_k] + [r.room for r in rows]) if head and rows else 0
        if batch == 0:
            return StepPlan.plain(0)
        if self.fixed_k is not None:
            k = min(self.fixed_k, head_cap)
            return StepPlan(k, k, [k] * batch, [HEAD if k else NONE] * batch)
        suffix_gain = [self._suffix_gains(r) for r in rows]
        plain_rate = batch / self.costs.step_cost(batch, 0)
        best, best_rate = StepPlan.plain(batch), plain_rate * self.margin
        widest = max([head_cap] + [len(g) - 1 for g in suffix_gain])
        for head_k in range(head_cap + 1):
            head_gain = expected_tokens(self.accept_rate, head_k) - 1
            for width in range(head_k, widest + 1):
                lengths, proposers, tokens = [], [], 0.0
                for gains in suffix_gain:
                    j = min(width, len(gains) - 1)
                    if head_k and head_gain >= gains[j]:
                        lengths.append(head_k), proposers.append(HEAD)
                        tokens += 1 + head_gain
                    else:
                        lengths.append(j), proposers.append(SUFFIX if j else NONE)
                        tokens += 1 + gains[j]
                if max(lengths) < width:
                    continue  # a narrower width gives the same drafts for less
                rate = tokens / self.costs.step_cost(batch, width, head_k if HEAD in proposers else 0)
                if rate > best_rate:
                    best, best_rate = StepPlan(width, head_k if HEAD in proposers else 0, lengths, proposers), rate
        if best.head_k == 0 and head_cap > 0 and self._steps_since_draft + 1 >= self.probe_every:
            best = self._probe(best, rows)
        if SUFFIX not in best.proposers and self._steps_since_suffix + 1 >= self.suffix_probe_every:
            best = self._probe_suffix(best, suffix_gain)
        return best

    def _suffix_gains(self, row: RowOffer) -> list[float]:
        """gains[j]: expected accepted tokens of the row's suffix draft cut to j tokens (gains[0] = 0)."""
        s, gains = self.suffix_calibration, [0.0]
        for c in row.suffix[: min(row.room, self.max_suffix)]:
            gains.append(gains[-1] + min(1.0, s * c))
        return gains

    def _probe(self, plan: StepPlan, rows: list[RowOffer]) -> StepPlan:
        """The plan with the head drafting one token for every row the plan leaves without a draft."""
        lengths, proposers = list(plan.lengths), list(plan.proposers)
        for b in range(len(rows)):
            if proposers[b] == NONE:
                lengths[b], proposers[b] = 1, HEAD
        return StepPlan(max(plan.width, 1), 1, lengths, proposers, probe=True)

    def _probe_suffix(self, plan: StepPlan, suffix_gain: list[list[float]]) -> StepPlan:
        """The plan with the suffix index drafting one token for the rows it has a draft for and
        the plan leaves without one."""
        lengths, proposers = list(plan.lengths), list(plan.proposers)
        for b, gains in enumerate(suffix_gain):
            if proposers[b] == NONE and len(gains) > 1:
                lengths[b], proposers[b] = 1, SUFFIX
        if SUFFIX not in proposers:
            return plan
        return StepPlan(max(plan.width, 1), plan.head_k, lengths, proposers, probe=plan.probe, suffix_probe=True)

    # ---- observe ------------------------------------------------------------------------------
    def observe(self, batch: int, k: int, seconds: float, accepted: list[int]) -> None:
        """One finished head-only step of `batch` rows drafting k tokens each."""
        plan = StepPlan(k, k, [k] * batch, [HEAD if k else NONE] * batch,
                        probe=k > 0 and self._steps_since_draft + 1 >= self.probe_every)
        self.observe_plan(plan, seconds, accepted, [[] for _ in range(batch)])

    def observe_plan(self, plan: StepPlan, seconds: float, accepted: list[int], suffix: list[list[float]]) -> None:
        """One finished step: its plan, wall time, each row's accepted drafts, and the cumulative
        confidences of each row's suffix draft (those of rows that used it are read)."""
        batch = len(plan.lengths)
        self.costs.observe(batch, plan.width, seconds, plan.head_k)
        suffix_rows = plan.rows_of(SUFFIX)
        for b in suffix_rows:
            predicted = sum(min(1.0, self.suffix_calibration * c) for c in suffix[b][: plan.lengths[b]])
            self._suffix_accepted = self.decay * self._suffix_accepted + accepted[b]
            self._suffix_predicted = self.decay * self._suffix_predicted + predicted
        if plan.suffix_probe:
            pays = any(accepted[b] for b in suffix_rows)
            self.suffix_probe_every = self.min_probe_every if pays else min(2 * self.suffix_probe_every,
                                                                            self.max_probe_every)
        self._steps_since_suffix = 0 if suffix_rows else self._steps_since_suffix + 1
        head_rows = plan.rows_of(HEAD)
        if not head_rows:
            self._steps_since_draft += 1
            return
        k = plan.head_k
        tried = sum(accepted[b] + (accepted[b] < k) for b in head_rows)
        self._accepted = self.decay * self._accepted + sum(accepted[b] for b in head_rows)
        self._tried = self.decay * self._tried + tried
        if plan.probe:
            pays = expected_tokens(self.accept_rate, 1) / self.costs.step_cost(batch, 1) > 1 / self.costs.step_cost(batch, 0)
            self.probe_every = self.min_probe_every if pays else min(2 * self.probe_every, self.max_probe_every)
        self._steps_since_draft = 0
