"""Plans each verify step: which proposer drafts for each sequence, and how many tokens.

Two proposers. The learned head (EAGLE) drafts k tokens for the rows given to it, one drafter pass
per token, all its rows together. The suffix index drafts from what traffic already said, at no
cost worth counting, a different length per row with a vote share per token.

Expected tokens. A step emits accepted + 1 tokens per row. With per-position acceptance rate a, a
head draft of k tokens emits E(k) = 1 + a + a^2 + ... + a^k. A suffix draft whose tokens are
accepted with conditional probabilities p_1, p_2, ... (`SuffixAcceptance`: learned live per match
length and source) emits 1 + sum_i p_1 * ... * p_i.

Cost. C(B, N, h): one target forward over the N = sum_b (1 + draft_b) real positions of the B
rows (the verify packs them: a row that drafts nothing costs one position, whatever the others
draft) plus h drafter passes when the head drafts h tokens. A start-up calibration gives the prior
for every (B, T) with N = B * T (a packed step reads as T = N / B, interpolated) and the drafter
pass, each point the fastest of a few rounds that visit every point in turn (a burst of load
during start-up, another process loading a model, falls on one round, not on one point). Observed
steps scale it: per batch size and kind of step (`CostModel`), the median of the last `window`
ratios of observed over predicted seconds (the machine's speed now, pooled over every step of that
size and kind, so that the curve's shape stays the calibrated one: a noisy timing of one width
cannot make it look free; a median, so that one step stalled by another process does not set the
scale of a batch size seen rarely afterwards, as a moving average let it: the engine's speed-up
estimate read 2.26x on rollouts that ran at 0.92x plain).

The plan maximises expected tokens per second over the head's k and each row's draft: for each k,
the rows whose whole suffix draft is worth less than the head's k tokens go to the head, and the
others take suffix tokens, best marginal gain first (a row's gains fall along its draft), as long
as the rate grows. Drafting must beat plain decoding by `margin` (5%): a useless drafter yields the
same tokens, and a noisy, inflated k = 0 timing must not make drafting look better. When a
proposer is not used, nobody learns whether it got better (a swap, traffic it now knows), so
every `probe_every` steps without it a probe drafts one token with it (the head for the rows left
without a draft, the suffix index for the rows it has a draft for); each probe that still does
not pay doubles that proposer's interval (up to `max_probe_every`). A drafter swap resets the
head's estimates. Last, the plan answers to measurement (`DraftGuard`), per proposer: where the
steps in which only the suffix index drafted yielded fewer tokens per second than plain steps, at
that batch size, the index pauses there; where the steps in which the head drafted yielded fewer
than plain steps or than the same plans made without the head (reference steps: now and then a
plan that gives the head rows is made again without it), the head pauses there. A pause backs
off as probes do, and the plan is made without that proposer. Why per proposer: one guard over
all drafting steps let the head's losing steps hide behind the index's winning ones (`bench
adapt`, 10 min, AVX2 EPYC: head + index 1.40x plain at B=1, the index alone 1.48x, the head alone
1.00x). Why the head's own reference: its steps carry the index's rows too, so they beat plain
steps while the head loses (`bench adapt`, B=4: head + index 1.10-1.14x plain against the index
alone 1.19-1.22x, the head alone 1.00x).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specrl.speculation.propose import propose
from specrl.speculation.sampling import RowSampler, SamplingParams
from specrl.speculation.suffix_acceptance import SuffixAcceptance
from specrl.speculation.suffix_index import SuffixDraft

HEAD, SUFFIX, NONE = "head", "suffix", ""
# The guard's reference for the head: a step planned with the head, made again without it.
WITHOUT_HEAD = "without-head"
PATIENCE = 4  # suffix tokens past the best rate tried before the planner stops adding them
PRIOR_MEMO = 65536  # memoised cost points kept (B, positions, head passes, head rows) before the memo starts over


def expected_tokens(accept_rate: float, k: int) -> float:
    """E(k) = sum_{i=0..k} a^i: tokens emitted per sequence by a step drafting k tokens."""
    return sum(accept_rate ** i for i in range(k + 1))


@dataclass
class CostModel:
    """Seconds per step by batch size B, verified positions N (all rows together: B with no drafts)
    and head draft length h.

    `target[(B, T)]`: one target forward over T positions for each of B sequences (interpolated
    over B and T between calibrated points); `draft[B]`: one drafter pass for B sequences;
    `scale[(B, kind)]`: observed over predicted seconds of whole steps of B sequences, apart for
    each kind of step (`StepPlan.kind`: the head drafted, only the suffix index drafted, nobody
    drafted; medians of the last `window`). A drafting step pays what the calibrated forwards leave
    out (proposing, assembling, packing the verify, the acceptance rule): measured in `bench adapt`
    at B=4, a scale pooled with plain steps let those steps look ~20% cheaper than they were, and
    the hybrid drafted itself below plain decoding. A head step pays more of it than an index step:
    its catch-up pass runs over every position verified since the row last drafted with the head
    (up to 17 after an index draft, where the prior counts one), and its passes' Python; pooled with
    the index's steps, which are most drafting steps, that went unseen (`bench adapt`, 10 min: the
    hybrid at B=4 1.10x plain against the index alone 1.22x, at the same 1.53 tokens a step). A kind
    not yet observed borrows the scale of the next in `_FALLBACK`."""

    target: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    scale: dict[tuple[int, bool], float] = field(default_factory=dict)
    window: int = 15
    _ratios: dict[tuple[int, bool], deque] = field(default_factory=dict, repr=False)
    # memos: the planner asks for ~70 cost points a step at B = 8, most of them every step (keys
    # carry the tables' sizes: the tables only grow while `measure` fills them)
    _priors: dict[tuple, float] = field(default_factory=dict, repr=False)
    _curves: dict[tuple[int, int], list] = field(default_factory=dict, repr=False)
    _least_draft: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    @classmethod
    def measure(cls, target, drafter, batches: list[int], positions: list[int], rounds: int = 3) -> "CostModel":
        """The prior, timed: a target forward (+ logits) over each T in `positions` for each B in
        `batches`, and one drafter pass per B (when there is a drafter): `propose` drafting one greedy
        token a row (its forward over one pending entry, the head, the argmax), on scratch KV caches; each
        the fastest of `rounds` rounds over all the points, after one warm-up call each; then made
        non-decreasing in T and in B (`_non_decreasing`)."""
        cache = target.new_cache(max(batches), max(positions) + 1)
        draft_cache = drafter.new_cache(max(batches), 2) if drafter is not None else None
        costs = cls()
        timings = []  # (the table, its key, the call to time)
        for bsz in batches:
            slots, start = torch.arange(bsz), torch.zeros(bsz, dtype=torch.long)
            for t in positions:
                tokens = torch.zeros(bsz, t, dtype=torch.long)
                timings.append((costs.target, (bsz, t), lambda x=tokens, s=slots, p=start:
                                target.logits(target(x, s, p, cache))))
            if drafter is not None:
                one, ones = torch.zeros(bsz, 1, dtype=torch.long), torch.ones(bsz, dtype=torch.long)
                feats = torch.zeros(bsz, 1, target.cfg.hidden_size, dtype=target.dtype)
                greedy = RowSampler.of([SamplingParams(temperature=0.0)] * bsz, [torch.Generator()] * bsz)
                timings.append((costs.draft, bsz, lambda f=feats, x=one, n=ones, s=slots, p=start, g=greedy:
                                propose(drafter, draft_cache, s, p, f, x, n, 1, g, p)))
        with torch.inference_mode():
            for _, _, fn in timings:
                fn()  # warm-up
            for _ in range(rounds):
                for table, key, fn in timings:
                    table[key] = min(table.get(key, float("inf")), _time(fn))
        costs.target = _non_decreasing(costs.target)
        return costs

    def prior_to_dict(self) -> dict:
        """The measured prior (`target`, `draft`), JSON-ready; `scale` is learned live and not kept."""
        return {"target": [[b, t, c] for (b, t), c in sorted(self.target.items())],
                "draft": [[b, c] for b, c in sorted(self.draft.items())]}

    @classmethod
    def prior_from_dict(cls, data: dict) -> "CostModel":
        return cls(target={(int(b), int(t)): float(c) for b, t, c in data["target"]},
                   draft={int(b): float(c) for b, c in data["draft"]})

    def step_cost(self, batch: int, width: int, head_k: int | None = None) -> float:
        """A step where every row drafts `width` tokens, the head drafting head_k of them (None:
        all): `verify_cost` with N = batch * (width + 1)."""
        return self.verify_cost(batch, batch * (width + 1), width if head_k is None else head_k)

    def verify_cost(self, batch: int, rows: int, head_k: int = 0, head_rows: int | None = None) -> float:
        """A step of `batch` sequences verifying `rows` positions, the head drafting head_k tokens
        for head_rows of them (None: all): the calibrated prior, scaled by what steps of this batch
        size took lately."""
        head_rows = batch if head_rows is None else head_rows
        return self._scale(batch, step_kind(batch, rows, head_k, head_rows)) * self._prior(batch, rows, head_k, head_rows)

    def plain_share(self, batch: int, rows: int, head_k: int, head_rows: int) -> float:
        """A plain step of `batch` rows as a share of a step verifying `rows` positions with head_k
        drafter passes over head_rows rows, by the calibrated curve alone: no scale, so that the
        share holds at whatever speed the machine runs now."""
        return self._prior(batch, batch, 0, batch) / self._prior(batch, rows, head_k, head_rows)

    def _scale(self, batch: int, kind: str) -> float:
        for borrowed in _FALLBACK[kind]:  # a loop, not a generator: the planner asks ~60 times a step
            scale = self.scale.get((batch, borrowed))
            if scale is not None:
                return scale
        return 1.0

    def _prior(self, batch: int, rows: int, head_k: int, head_rows: int) -> float:
        # h drafter passes: the catch-up pass over the newly verified positions yields the first
        # draft token, then h-1 single-position passes.
        key = (batch, rows, head_k, head_rows, len(self.target), len(self.draft))
        memo = self._priors
        cost = memo.get(key)
        if cost is None:
            if len(memo) >= PRIOR_MEMO:
                memo.clear()
            cost = memo[key] = (self._interp_target(batch, rows / batch)
                                + (head_k * self._interp_draft(head_rows) if head_k else 0.0))
        return cost

    def observe(self, batch: int, width: int, seconds: float, head_k: int | None = None) -> None:
        """One head-only step of `batch` rows drafting `width` tokens each (head_k None: all of them)."""
        self.observe_rows(batch, batch * (width + 1), seconds, width if head_k is None else head_k)

    def observe_rows(self, batch: int, rows: int, seconds: float, head_k: int, head_rows: int | None = None) -> None:
        head_rows = batch if head_rows is None else head_rows
        ratio = seconds / self._prior(batch, rows, head_k, head_rows)
        key = (batch, step_kind(batch, rows, head_k, head_rows))
        ratios = self._ratios.setdefault(key, deque(maxlen=self.window))
        ratios.append(ratio)
        self.scale[key] = statistics.median(ratios)

    def _interp_target(self, batch: int, t: float) -> float:
        """Linear interpolation over the calibrated batch sizes, then over positions (the curve of
        each batch size is built once: the planner asks for hundreds of points per step)."""
        if not self.target:
            return 1.0 + 0.6 * (t > 1) + 0.1 * t  # no calibration: pessimistic (a 2+ row forward ~1.6x one row)
        memo = self._curves
        key = (batch, len(self.target))
        if key not in memo:
            ts = sorted({tt for (_, tt) in self.target})
            memo[key] = [(tt, _interpolate(sorted((b, c) for (b, t2), c in self.target.items() if t2 == tt), batch))
                         for tt in ts]
        return _interpolate(memo[key], t)

    def least_head_cost(self, batch: int, head_k: int) -> float:
        """A lower bound on `verify_cost` of any step of `batch` rows in which the head drafts
        head_k > 0 tokens for at least one row: at least head_k positions past the batch's own, and
        head_k passes at the cheapest batch size of the drafter's curve (the target's curve is
        non-decreasing in positions; the drafter's is not made so)."""
        key = (batch, len(self.draft))
        least = self._least_draft.get(key)
        if least is None:
            least = self._least_draft[key] = min(self._interp_draft(b) for b in range(1, batch + 1))
        return self._scale(batch, HEAD) * (self._interp_target(batch, (batch + head_k) / batch) + head_k * least)

    def _interp_draft(self, batch: int) -> float:
        points = sorted(self.draft.items())
        return _interpolate(points, batch) if points else 0.2


# the scale a kind of step borrows until it has been observed: the other drafting kind's first
_FALLBACK = {HEAD: (HEAD, SUFFIX, NONE), SUFFIX: (SUFFIX, HEAD, NONE), NONE: (NONE, SUFFIX, HEAD)}


def step_kind(batch: int, rows: int, head_k: int, head_rows: int) -> str:
    """A step's kind: HEAD when the head drafted for any row (its passes are the step's extra cost),
    else SUFFIX when any row verifies drafts (the index's), else NONE (a plain step). From the cost
    model's arguments, so that the planner's costs and the plans it observes file steps alike."""
    return HEAD if head_k and head_rows else SUFFIX if rows > batch else NONE


def _non_decreasing(table: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """(B, T) -> seconds, each point raised to the largest of the points with no more rows and no
    more positions. A forward over more positions never costs less; a point timed below a smaller
    one is noise (measured: B=1 T=3 15.2 ms after T=2 15.9 ms), and it told the planner that the
    wider verify was free."""
    out = {}
    for b, t in sorted(table):
        out[(b, t)] = max([table[(b, t)]] + [c for (b2, t2), c in out.items() if b2 <= b and t2 <= t])
    return out


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
class DraftGuard:
    """Per batch size and proposer, what drafting really yields: tokens per second of the steps of
    each kind (`StepPlan.guard_kind`: the head drafted, only the suffix index drafted, nobody
    drafted, a plan made again without the head), each the total tokens over the total seconds of
    its last `window` real steps (probes count in none). A ratio of sums, not a moving average of
    per-step rates: a drafting step yields 1 to 17 tokens, and the average of per-step rates that
    this replaced let four unlucky first drafts pause a suffix index that paid 1.2x over the same
    prompts.

    The planner's rate is a model (a calibrated curve, live acceptance); this is the measurement
    that keeps it honest. After `min_steps` drafting steps of B rows, plain steps of B rows are
    needed to compare with: a plan that would draft is run plain until `min_steps` of them are
    measured, and again (one step) whenever that measurement is `refresh_every` steps old (what a
    plain step costs drifts with context length and load). The head has a second reference, by the
    same rule: plans that give the head rows, made again without it (`head_reference_due`), which
    measures what the head's rows would have yielded otherwise, the index's drafts included. When
    the index's steps yield fewer tokens/s than plain ones, or the head's fewer than plain ones or
    than its reference, that proposer pauses at B for `pause` steps, then gets a fresh trial
    of `min_steps` steps; each trial that still loses doubles its pause (up to `max_pause`), one
    that wins resets it. The cost of being wrong is bounded: min_steps losing steps a pause."""

    min_steps: int = 8
    window: int = 32
    refresh_every: int = 64
    min_pause: int = 32
    max_pause: int = 1024
    _recent: dict[tuple[int, str], deque] = field(default_factory=dict)  # (B, kind) -> (tokens, seconds) of steps
    _last_reference: dict[tuple[int, str], int] = field(default_factory=dict)  # (B, NONE or WITHOUT_HEAD) -> step
    _paused_until: dict[tuple[int, str], int] = field(default_factory=dict)
    _pause: dict[tuple[int, str], int] = field(default_factory=dict)
    _steps: int = 0

    def allows(self, batch: int, proposer: str) -> bool:
        """Whether `proposer` (HEAD or SUFFIX) may draft at this batch size now (False: paused, or a
        plain reference step is due)."""
        return self._steps >= self._paused_until.get((batch, proposer), 0) and not self._plain_due(batch)

    def head_reference_due(self, batch: int) -> bool:
        """The head has min_steps steps at this batch size and the steps planned without it where
        it would have drafted are missing or old: the next such plan is made without the head."""
        return self._reference_due(batch, WITHOUT_HEAD, (HEAD,))

    def _plain_due(self, batch: int) -> bool:
        """A proposer has min_steps steps at this batch size and the plain reference is missing or
        old: the next steps run plain, whoever would draft (both proposers compare with it)."""
        return self._reference_due(batch, NONE, (HEAD, SUFFIX))

    def _reference_due(self, batch: int, reference: str, judged: tuple[str, ...]) -> bool:
        stale = (self.rate(batch, reference) is None
                 or self._steps - self._last_reference.get((batch, reference), 0) >= self.refresh_every)
        return stale and any(len(self._recent.get((batch, kind), ())) >= self.min_steps for kind in judged)

    def rate(self, batch: int, kind: str) -> float | None:
        """Measured tokens/s of steps of `batch` rows of this kind (HEAD, SUFFIX, NONE: plain,
        WITHOUT_HEAD); None before min_steps."""
        recent = self._recent.get((batch, kind), ())
        if len(recent) < self.min_steps:
            return None
        return sum(t for t, _ in recent) / sum(s for _, s in recent)

    def observe(self, batch: int, kind: str, tokens: int, seconds: float) -> None:
        self._steps += 1
        if seconds <= 0:
            return
        self._recent.setdefault((batch, kind), deque(maxlen=self.window)).append((tokens, seconds))
        if kind in (NONE, WITHOUT_HEAD):
            self._last_reference[(batch, kind)] = self._steps
            return
        plain, draft = self.rate(batch, NONE), self.rate(batch, kind)
        if plain is None or draft is None:
            return
        # the head must also beat the same plans made without it, once those are measured
        reference = max(plain, self.rate(batch, WITHOUT_HEAD) or 0.0) if kind == HEAD else plain
        key = (batch, kind)
        if draft < reference:  # pause, and judge the next trial on fresh steps alone
            pause = self._pause.get(key, self.min_pause)
            self._paused_until[key] = self._steps + pause
            self._pause[key] = min(2 * pause, self.max_pause)
            del self._recent[key]
        else:
            self._pause[key] = self.min_pause


@dataclass
class RowOffer:
    """What one sequence can take this step: at most `room` draft tokens (its max_tokens and
    context left), and the suffix index's draft (None: no index, or nothing to draft)."""

    room: int
    suffix: SuffixDraft | None = None


@dataclass
class StepPlan:
    width: int  # K: the longest draft of the step (rows shorter than it are packed, not padded)
    head_k: int  # tokens the head drafts for its rows (0: it does not draft)
    lengths: list[int]  # per row: draft tokens
    proposers: list[str]  # per row: HEAD, SUFFIX or NONE
    probe: bool = False  # the head drafts to learn whether it pays (not because it does)
    suffix_probe: bool = False  # the same for the suffix index
    head_reference: bool = False  # planned without the head where the plan gave it rows (`DraftGuard`)

    @classmethod
    def plain(cls, batch: int) -> "StepPlan":
        return cls(0, 0, [0] * batch, [NONE] * batch)

    @property
    def rows(self) -> int:
        """Positions the verify forward computes: each row's pending token and its drafts."""
        return len(self.lengths) + sum(self.lengths)

    def rows_of(self, proposer: str) -> list[int]:
        return [b for b, p in enumerate(self.proposers) if p == proposer]

    @property
    def kind(self) -> str:
        """What the cost scales file the step under (`step_kind`)."""
        return step_kind(len(self.lengths), self.rows, self.head_k, len(self.rows_of(HEAD)))

    @property
    def guard_kind(self) -> str:
        """What the guard files the step under: its kind, or the head's reference."""
        return WITHOUT_HEAD if self.head_reference else self.kind


class SpeculationController:
    def __init__(self, max_k: int, costs: CostModel | None = None, *, fixed_k: int | None = None,
                 initial_accept_rate: float = 0.5, decay: float = 0.9, probe_every: int = 16,
                 max_probe_every: int = 256, margin: float = 1.05, max_suffix: int = 16,
                 suffix_acceptance: SuffixAcceptance | None = None):
        self.max_k, self.max_suffix = max_k, max_suffix
        self.margin = margin
        self.fixed_k = fixed_k  # the head always drafts this many (benchmarks, tests); None: choose
        self.costs = costs or CostModel()
        self.guard = DraftGuard()
        self.initial_accept_rate = initial_accept_rate
        self.decay = decay
        self.min_probe_every, self.max_probe_every = probe_every, max_probe_every
        # Starts at 0.5 a unit of vote share: a first step trusting 1.0 verified 16 positions it did not pay for.
        self.suffix_acceptance = suffix_acceptance or SuffixAcceptance()
        self.suffix_probe_every, self._steps_since_suffix = probe_every, 0
        self.reset()

    def reset(self, initial_accept_rate: float | None = None) -> None:
        """Forget the head's acceptance (a new drafter was swapped in), starting again from
        initial_accept_rate (None: the one given at construction)."""
        if initial_accept_rate is not None:
            self.initial_accept_rate = initial_accept_rate
        self._accepted, self._tried = self.initial_accept_rate, 1.0
        self.probe_every = self.min_probe_every
        self._steps_since_draft = 0

    @property
    def accept_rate(self) -> float:
        """The head's per-position acceptance rate (moving estimate)."""
        return self._accepted / self._tried

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
        # a proposer measured slower than plain decoding at this batch size (or waiting for a plain
        # reference step) is left out of the plan
        usable = suffix_gain if self.guard.allows(batch, SUFFIX) else [[0.0]] * batch
        head_ks = head_cap + 1 if self.guard.allows(batch, HEAD) else 1
        # every row's suffix tokens by marginal gain, best first (ties: row, then position), once a step
        marginal = sorted(((gains[i + 1] - gains[i], b) for b, gains in enumerate(usable) for i in range(len(gains) - 1)),
                          key=lambda x: -x[0])
        best = self._best(usable, marginal, head_ks)
        if best.head_k and self.guard.head_reference_due(batch):  # the same step without the head, measured
            reference = self._best(usable, marginal, 1)
            reference.head_reference = True
            return reference
        if best.head_k == 0 and head_cap > 0 and self._steps_since_draft + 1 >= self.probe_every:
            best = self._probe(best, rows)
        if SUFFIX not in best.proposers and self._steps_since_suffix + 1 >= self.suffix_probe_every:
            best = self._probe_suffix(best, suffix_gain)
        return best

    def _best(self, suffix_gain: list[list[float]], marginal: list[tuple[float, int]], head_ks: int) -> StepPlan:
        """The plan of most expected tokens/s with the head drafting fewer than head_ks tokens
        (1: not at all); plain unless drafting beats it by `margin`."""
        batch = len(suffix_gain)
        best, best_rate = StepPlan.plain(batch), batch / self.costs.verify_cost(batch, batch) * self.margin
        longest = [gains[-1] for gains in suffix_gain]  # each row's whole suffix draft, in expected tokens
        for head_k in range(head_ks):
            # Skip a k whose best conceivable plan (every row its better proposer's whole draft, at
            # the least cost of a step with the head) cannot beat the best so far: the same plan,
            # found with ~70 fewer cost points a step at B = 8 (planning took 0.26 ms a step, q4).
            if head_k:
                head_gain = expected_tokens(self.accept_rate, head_k) - 1
                most = batch + sum(max(head_gain, g) for g in longest)
                if most / self.costs.least_head_cost(batch, head_k) <= best_rate:
                    continue
            plan, rate = self._best_with_head(suffix_gain, marginal, head_k)
            if rate > best_rate:
                best, best_rate = plan, rate
        return best

    def _best_with_head(self, suffix_gain: list[list[float]], marginal: list[tuple[float, int]],
                        head_k: int) -> tuple[StepPlan, float]:
        """The best plan in which the head drafts head_k tokens (0: not at all) -> (plan, tokens/s).
        Rows go to the head when their whole suffix draft is worth less; the others take suffix
        tokens in order of marginal gain (`marginal`: (gain, row) of every row's suffix tokens, best
        first) while the rate grows (the cost grows with every position)."""
        batch = len(suffix_gain)
        head_gain = expected_tokens(self.accept_rate, head_k) - 1
        on_head = [head_k > 0 and head_gain > gains[-1] for gains in suffix_gain]
        lengths = [head_k if h else 0 for h in on_head]
        used_head, head_rows = (head_k, sum(on_head)) if any(on_head) else (0, 0)
        tokens, rows = batch + head_gain * head_rows, batch + sum(lengths)
        best_lengths, best_rate = list(lengths), tokens / self.costs.verify_cost(batch, rows, used_head, head_rows)
        worse = 0
        for gain, b in marginal:
            if on_head[b]:
                continue
            lengths[b] += 1
            tokens, rows = tokens + gain, rows + 1
            rate = tokens / self.costs.verify_cost(batch, rows, used_head, head_rows)
            if rate > best_rate:
                best_lengths, best_rate, worse = list(lengths), rate, 0
            else:
                worse += 1
                if worse == PATIENCE:  # gains only fall from here and each position costs about the same
                    break
        proposers = [HEAD if h else (SUFFIX if n else NONE) for h, n in zip(on_head, best_lengths)]
        return StepPlan(max(best_lengths), used_head, best_lengths, proposers), best_rate

    def _suffix_gains(self, row: RowOffer) -> list[float]:
        """gains[j]: expected accepted tokens of the row's suffix draft cut to j tokens (gains[0] = 0)."""
        return self.suffix_acceptance.gains(row.suffix, min(row.room, self.max_suffix))

    def _probe(self, plan: StepPlan, rows: list[RowOffer]) -> StepPlan:
        """The plan with the head drafting one token for one row the plan leaves without a draft:
        the verify is packed, so a probe costs one position and the catch-up of one row, not the
        whole batch's (measured on SmolLM2 at B=8: a probe over every row cost 3.8x a plain step)."""
        free = [b for b in range(len(rows)) if plan.proposers[b] == NONE and rows[b].room > 0]
        if not free:
            return plan
        lengths, proposers = list(plan.lengths), list(plan.proposers)
        lengths[free[0]], proposers[free[0]] = 1, HEAD
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

    def plain_seconds(self, plan: StepPlan, seconds: float, emitted: int) -> float:
        """What plain decoding would have spent on the `emitted` tokens of a step that took `seconds`
        under `plan`: plain steps of the same B rows (B tokens each), each costing the calibrated
        share of this step's own time. The step's own time, not the scaled model: a batch size seen
        rarely keeps the scale of whenever it was last seen, and the engine's speed-up estimate read
        1.27x on RL rollouts measured at 0.93x plain, when the machine had gone quiet since those
        batch sizes were last observed under training load. A plain step counts its own seconds
        exactly; a drafting step trusts the curve's shape, which leaves out what a drafting step
        costs beyond its forwards (proposing, the acceptance rule): the estimate leans optimistic
        by that much."""
        batch = len(plan.lengths)
        share = self.costs.plain_share(batch, plan.rows, plan.head_k, len(plan.rows_of(HEAD)))
        return seconds * share * emitted / batch

    # ---- observe ------------------------------------------------------------------------------
    def observe(self, batch: int, k: int, seconds: float, accepted: list[int]) -> None:
        """One finished head-only step of `batch` rows drafting k tokens each."""
        plan = StepPlan(k, k, [k] * batch, [HEAD if k else NONE] * batch,
                        probe=k > 0 and self._steps_since_draft + 1 >= self.probe_every)
        self.observe_plan(plan, seconds, accepted, [None] * batch)

    def observe_plan(self, plan: StepPlan, seconds: float, accepted: list[int],
                     suffix: list[SuffixDraft | None]) -> None:
        """One finished step: its plan, wall time, each row's accepted drafts, and each row's suffix
        draft as offered (those of rows that used it are read)."""
        batch = len(plan.lengths)
        if not (plan.probe or plan.suffix_probe):  # a probe drafts to learn, not at the cost it chose
            self.costs.observe_rows(batch, plan.rows, seconds, plan.head_k, len(plan.rows_of(HEAD)))
            self.guard.observe(batch, plan.guard_kind, batch + sum(accepted), seconds)
        suffix_rows = plan.rows_of(SUFFIX)
        for b in suffix_rows:
            self.suffix_acceptance.observe(suffix[b], plan.lengths[b], accepted[b])
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
