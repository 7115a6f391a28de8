"""Draft-length controller (specrl/speculation/controller.py) with measured-shape costs: a target forward
over T positions at B=1 costs 1.0 for T=1 and 1.6-2.0 for T=2..5; one drafter pass costs 0.1."""

from __future__ import annotations

import itertools

import pytest
import torch

from specrl.speculation.controller import (HEAD, NONE, SUFFIX, WITHOUT_HEAD, CostModel, RowOffer, SpeculationController,
                                   StepPlan, _non_decreasing, expected_tokens)
from specrl.speculation.suffix_acceptance import SuffixAcceptance, match_bucket
from specrl.speculation.suffix_index import SuffixDraft

TARGET_B1 = {1: 1.0, 2: 1.6, 3: 1.7, 4: 1.8, 5: 2.0}
DRAFT_B1 = 0.1


def facts_costs() -> CostModel:
    return CostModel(target={(1, t): c for t, c in TARGET_B1.items()}, draft={1: DRAFT_B1})


def step_cost(k: int) -> float:
    return TARGET_B1[k + 1] + k * DRAFT_B1


def closed_form(a: float, k: int) -> float:
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def test_plain_seconds_follow_the_steps_own_time_not_a_stale_scale():
    """The engine's speed-up estimate: a plain step is worth exactly its own seconds, and a drafting
    step its own seconds times the calibrated plain share, whatever the scale learned under an
    earlier load (a batch size last seen while training ran beside the server)."""
    ctl = SpeculationController(4, facts_costs())
    for _ in range(20):
        ctl.costs.observe(1, 0, 3 * step_cost(0))  # observed 3x slower than calibrated, earlier
    plain = StepPlan.plain(1)
    assert ctl.plain_seconds(plain, 0.01, 1) == pytest.approx(0.01)  # now quiet: 0.01 s is 0.01 s
    drafting = StepPlan(2, 2, [2], [HEAD])
    assert ctl.plain_seconds(drafting, 0.02, 3) == pytest.approx(0.02 * step_cost(0) / step_cost(2) * 3)


# ---- expected_tokens ---------------------------------------------------------------------------

@pytest.mark.parametrize("a", [0.0, 0.05, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("k", [0, 1, 2, 4, 8])
def test_expected_tokens_closed_form(a, k):
    assert expected_tokens(a, k) == pytest.approx(closed_form(a, k), rel=1e-12)


# ---- CostModel ---------------------------------------------------------------------------------

def test_step_cost_composes_calibration():
    costs = facts_costs()
    for k in range(5):
        assert costs.step_cost(1, k) == pytest.approx(step_cost(k))


def test_observed_steps_scale_the_calibrated_curve():
    costs = facts_costs()
    costs.observe(1, 2, 2 * step_cost(2))  # the machine runs at half the calibrated speed now
    assert costs.step_cost(1, 2) == pytest.approx(2 * step_cost(2))  # the first observation sets the scale
    assert costs.step_cost(1, 1) == pytest.approx(2 * step_cost(1))  # every width of B = 1 moves alike
    assert costs.step_cost(1, 0) == pytest.approx(2 * step_cost(0))  # plain steps borrow it until observed
    costs.observe(1, 2, 1.0 * step_cost(2))  # then drafting steps at the calibrated speed
    assert costs.step_cost(1, 2) == pytest.approx(1.5 * step_cost(2))  # the median of the ratios 2 and 1
    costs.observe(1, 1, 1.2 * step_cost(1))
    assert costs.step_cost(1, 2) == pytest.approx(1.2 * step_cost(2))
    costs.observe(1, 0, 1.5 * step_cost(0))  # plain steps keep a scale of their own
    assert costs.step_cost(1, 0) == pytest.approx(1.5 * step_cost(0))
    assert costs.step_cost(1, 1) == pytest.approx(1.2 * step_cost(1))
    assert costs.step_cost(2, 2) == pytest.approx(2 * step_cost(2))  # other batch sizes keep their prior
    assert costs.step_cost(1, 3) > costs.step_cost(1, 2) > costs.step_cost(1, 1)  # the calibrated shape


def test_one_stalled_step_does_not_set_the_scale():
    """Another process stalls one plain step 20x: the scale of that batch size keeps the steps'
    typical speed (a moving average kept ~4x for the next several steps), and a change in the
    machine's speed that lasts moves it within half a window."""
    costs = facts_costs()
    for _ in range(6):
        costs.observe(1, 0, step_cost(0))
    costs.observe(1, 0, 20 * step_cost(0))
    assert costs.step_cost(1, 0) == pytest.approx(step_cost(0))
    for _ in range(costs.window // 2 + 1):
        costs.observe(1, 0, 2 * step_cost(0))  # the machine is twice as slow now
    assert costs.step_cost(1, 0) == pytest.approx(2 * step_cost(0))


def test_head_steps_keep_a_cost_scale_of_their_own():
    """A head step pays more than its prior (its catch-up runs over every position verified since the
    row last drafted with the head): head steps observed at 3x their prior scale head plans only;
    index steps and plain steps keep their own scales, and a kind not yet seen borrows the other
    drafting kind's before plain's."""
    costs = facts_costs()
    head_prior, index_prior = costs.verify_cost(1, 3, 2, 1), costs.verify_cost(1, 3)
    costs.observe_rows(1, 3, 3 * head_prior, head_k=2, head_rows=1)
    assert costs.verify_cost(1, 3) == pytest.approx(3 * index_prior)  # the index borrows the head's until seen
    costs.observe_rows(1, 3, index_prior, head_k=0)
    assert costs.verify_cost(1, 3, 2, 1) == pytest.approx(3 * head_prior)
    assert costs.verify_cost(1, 3) == pytest.approx(index_prior)
    assert costs.verify_cost(1, 1) == pytest.approx(costs._prior(1, 1, 0, 1))  # plain borrows the index's
    costs.observe_rows(1, 1, 2 * costs._prior(1, 1, 0, 1), head_k=0)
    assert costs.verify_cost(1, 1) == pytest.approx(2 * costs._prior(1, 1, 0, 1))
    assert costs.verify_cost(2, 3) == pytest.approx(costs._prior(2, 3, 0, 2))  # another batch size: its prior


def test_slow_head_steps_send_a_row_to_the_index_not_to_plain_decoding():
    """The model prefers the head for a row whose index draft is weak; head steps then measure at 3x
    their cost and index steps as modelled. The row goes to the index: a scale pooled over both
    kinds (the median of 3 and 1 is 3 when head steps are the most) priced the index's steps at the
    head's overhead too, and the row went plain."""
    ctl = SpeculationController(4, wide_costs(), initial_accept_rate=0.7,
                                suffix_acceptance=SuffixAcceptance(initial=1.0), probe_every=10 ** 6)
    offer = [RowOffer(100, suffix([0.5]))]
    plan = ctl.plan(offer, head=True)
    assert plan.proposers == [HEAD] and plan.head_k == 3
    for _ in range(8):
        ctl.costs.observe_rows(1, plan.rows, 3 * ctl.costs._prior(1, plan.rows, 3, 1), 3, 1)
    for _ in range(7):
        ctl.costs.observe_rows(1, 2, ctl.costs._prior(1, 2, 0, 1), 0)
    assert ctl.plan(offer, head=True).proposers == [SUFFIX]


def test_step_cost_interpolates_over_batch():
    costs = CostModel(target={(2, 1): 1.0, (8, 1): 2.2, (2, 3): 2.0, (8, 3): 3.2}, draft={2: 0.2, 8: 0.5})
    assert costs.step_cost(2, 0) == pytest.approx(1.0)
    assert costs.step_cost(5, 0) == pytest.approx(1.6)  # linear between calibrated batch sizes
    assert costs.step_cost(1, 0) == pytest.approx(0.5)  # below the first point: proportional
    assert costs.step_cost(16, 0) == pytest.approx(4.4)  # above the last point: proportional
    assert costs.step_cost(5, 2) == pytest.approx(2.6 + 2 * 0.35)


def test_uncalibrated_costs_are_usable():
    costs = CostModel()
    c = [costs.step_cost(1, k) for k in range(6)]
    assert all(x > 0 for x in c)
    assert c == sorted(c) and c[0] < c[1]  # drafting more never looks cheaper


# ---- choose ------------------------------------------------------------------------------------

def test_high_acceptance_drafts_max_k():
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=0.9)
    assert ctl.choose(1, 10) == 4


@pytest.mark.parametrize("cap, max_k, want", [(2, 4, 2), (1, 4, 1), (0, 4, 0), (-1, 4, 0), (10, 2, 2), (10, 0, 0)])
def test_cap_and_max_k_limit_k(cap, max_k, want):
    ctl = SpeculationController(max_k, facts_costs(), initial_accept_rate=0.9)
    assert ctl.choose(1, cap) == want


def test_empty_batch_drafts_nothing():
    assert SpeculationController(4, facts_costs(), initial_accept_rate=0.9).choose(0, 4) == 0


@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.99])
def test_choice_maximises_tokens_per_cost(a):
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=a, probe_every=10 ** 6)
    rate = {k: closed_form(a, k) / step_cost(k) for k in range(5)}
    best = max(rate, key=rate.get)
    if rate[best] < ctl.margin * rate[0]:
        best = 0  # drafting must pay by the margin
    assert ctl.choose(1, 4) == best


def test_drafting_must_beat_plain_by_the_margin():
    """With a drafter that accepts nothing, k > 0 never wins even when it looks slightly cheaper."""
    costs = facts_costs()
    costs.observe(1, 0, 1.0)
    costs.observe(1, 1, 0.99)  # a noisy measurement: drafting looks 1% cheaper
    ctl = SpeculationController(4, costs, initial_accept_rate=0.0, probe_every=10 ** 6)
    assert ctl.choose(1, 4) == 0


def test_choice_grows_with_acceptance():
    ks = [SpeculationController(4, facts_costs(), initial_accept_rate=a / 20, probe_every=10 ** 6).choose(1, 4)
          for a in range(21)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 4


def _simulate(ctl: SpeculationController, steps: int, accepted_of_probe=lambda i: 0) -> list[int]:
    """Run `steps` B=1 steps at their prior cost; a drafting step accepts accepted_of_probe(i)."""
    ks = []
    for i in range(steps):
        k = ctl.choose(1, 4)
        ks.append(k)
        ctl.observe(1, k, ctl.costs.step_cost(1, k), [min(accepted_of_probe(i), k)] if k else [0])
    return ks


def test_low_acceptance_plain_decoding_with_backing_off_probes():
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=0.05, probe_every=4, max_probe_every=16)
    ks = _simulate(ctl, 100)
    assert set(ks) == {0, 1}, "only plain steps and k=1 probes"
    probes = [i for i, k in enumerate(ks) if k == 1]
    assert probes[0] == 3  # the probe_every-th step
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == [8, 16, 16, 16, 16, 16]  # doubles after each unpaid probe, bounded by max_probe_every
    assert ctl.probe_every == 16


def test_a_probe_that_pays_resets_the_interval():
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=0.05, decay=0.0, probe_every=2,
                                max_probe_every=64)
    _simulate(ctl, 2 + 4 + 8)  # probes at steps 1, 5, 13, none accepted
    assert ctl.probe_every == 16
    ks = _simulate(ctl, 16, accepted_of_probe=lambda i: 1)  # the next probe (step 15 of these) accepts its draft
    assert ks[:15] == [0] * 15 and ks[15] == 1
    assert ctl.accept_rate == 1.0
    assert ctl.probe_every == 2
    assert ctl.choose(1, 4) == 4


def test_observe_updates_acceptance_estimate():
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=0.5, decay=0.9)
    assert ctl.accept_rate == pytest.approx(0.5)
    ctl.observe(1, 4, 1.0, [2])  # 2 accepted of 3 tried (the third was rejected)
    acc, tried = 0.9 * 0.5 + 2, 0.9 * 1.0 + 3
    assert ctl.accept_rate == pytest.approx(acc / tried)
    ctl.observe(1, 4, 1.0, [4])  # all accepted: 4 tried, no rejection
    acc, tried = 0.9 * acc + 4, 0.9 * tried + 4
    assert ctl.accept_rate == pytest.approx(acc / tried)
    ctl.observe(3, 2, 1.0, [0, 2, 1])  # 3 accepted; tried 1 + 2 + 2
    acc, tried = 0.9 * acc + 3, 0.9 * tried + 5
    assert ctl.accept_rate == pytest.approx(acc / tried)
    ctl.observe(3, 0, 1.0, [0, 0, 0])  # plain steps teach nothing about acceptance
    assert ctl.accept_rate == pytest.approx(acc / tried)


def test_acceptance_estimate_tracks_the_true_rate():
    g = torch.Generator().manual_seed(0)
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=0.9, decay=0.99)
    true_rate, k, batch = 0.3, 4, 8
    for _ in range(400):
        hits = torch.rand(batch, k, generator=g) < true_rate
        accepted = hits.long().cumprod(-1).sum(-1).tolist()  # prefix of per-position successes
        ctl.observe(batch, k, 1.0, accepted)
    # ~1100 effective tries in the window: standard error ~0.014; bound 0.05 (~3.5 sigma).
    assert abs(ctl.accept_rate - true_rate) < 0.05


def test_falling_acceptance_turns_speculation_off():
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=0.9, probe_every=10 ** 6)
    ks = _simulate(ctl, 30)  # every draft is rejected
    assert ks[0] == 4
    assert ks[-1] == 0
    assert ks == sorted(ks, reverse=True)


def test_reset_restores_the_initial_state():
    ctl = SpeculationController(4, facts_costs(), initial_accept_rate=0.05, probe_every=4, max_probe_every=16)
    _simulate(ctl, 37)
    assert ctl.probe_every > 4 and ctl.accept_rate < 0.05
    ctl.reset()
    assert ctl.accept_rate == pytest.approx(0.05)
    assert ctl.probe_every == 4
    fresh = SpeculationController(4, facts_costs(), initial_accept_rate=0.05, probe_every=4, max_probe_every=16)
    assert _simulate(ctl, 40) == _simulate(fresh, 40)


def test_fixed_k_overrides_the_choice():
    ctl = SpeculationController(4, facts_costs(), fixed_k=3, initial_accept_rate=0.0)
    assert ctl.choose(1, 10) == 3
    assert ctl.choose(1, 2) == 2
    assert ctl.choose(0, 10) == 0
    off = SpeculationController(4, facts_costs(), fixed_k=0, probe_every=2)
    assert _simulate(off, 10) == [0] * 10  # no probes either


# ---- plan: the suffix index beside the head ----------------------------------------------------

WIDE = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2, 9: 1.6, 17: 2.4}  # a flat small-M cost curve


def wide_costs(batch: int = 1) -> CostModel:
    return CostModel(target={(batch, t): c for t, c in WIDE.items()}, draft={batch: 0.1})


def trusting(*args, **kwargs) -> SpeculationController:
    """A controller that takes the suffix index's vote shares at face value (q = 1) until it learns otherwise."""
    return SpeculationController(*args, suffix_acceptance=SuffixAcceptance(initial=1.0), **kwargs)


def suffix(shares: list[float], match_length: int = 4, own: bool = False) -> SuffixDraft:
    """A suffix draft with these vote shares (its tokens 0, 1, ...)."""
    return SuffixDraft(list(range(len(shares))), list(shares), match_length, own)


def test_a_confident_suffix_draft_is_taken_whole():
    ctl = trusting(4, wide_costs(), initial_accept_rate=0.0, probe_every=10 ** 6)
    plan = ctl.plan([RowOffer(20, suffix([1.0] * 8))], head=True)
    assert (plan.width, plan.head_k, plan.lengths, plan.proposers) == (8, 0, [8], [SUFFIX])


def test_an_unconfident_suffix_draft_is_cut_or_dropped():
    ctl = SpeculationController(4, wide_costs(), initial_accept_rate=0.0, probe_every=10 ** 6)
    assert ctl.plan([RowOffer(20, suffix([0.9, 0.6, 0.1, 0.2]))], head=True).lengths[0] in (1, 2)
    assert ctl.plan([RowOffer(20, suffix([0.01, 0.1]))], head=True).proposers == [NONE]
    assert ctl.plan([RowOffer(20, None)], head=True).proposers == [NONE]


def test_each_row_takes_the_better_proposer():
    """Row 0 has a confident suffix draft; row 1 has none, and the head accepts well."""
    ctl = trusting(4, wide_costs(2), initial_accept_rate=0.95, probe_every=10 ** 6)
    plan = ctl.plan([RowOffer(20, suffix([1.0] * 6)), RowOffer(20, suffix([]))], head=True)
    assert plan.proposers == [SUFFIX, HEAD]
    assert plan.lengths[0] == plan.width >= plan.lengths[1] == plan.head_k > 0
    assert plan.rows == 2 + plan.lengths[0] + plan.lengths[1]  # packed: each row its own length
    assert plan.rows_of(HEAD) == [1] and plan.rows_of(SUFFIX) == [0]


def test_room_caps_suffix_drafts():
    ctl = trusting(4, wide_costs(), initial_accept_rate=0.0, probe_every=10 ** 6)
    assert ctl.plan([RowOffer(3, suffix([1.0] * 10))], head=False).lengths == [3]
    assert ctl.plan([RowOffer(0, suffix([1.0] * 10))], head=False).proposers == [NONE]


def test_without_a_head_only_the_suffix_or_nothing_drafts():
    ctl = SpeculationController(0, wide_costs(), initial_accept_rate=0.9, probe_every=2)
    for _ in range(5):  # no probes without a head
        plan = ctl.plan([RowOffer(20, None)], head=False)
        assert plan.proposers == [NONE] and plan.width == 0
        ctl.observe_plan(plan, 1.0, [0], [None])


def test_suffix_acceptance_follows_live_acceptance():
    ctl = SpeculationController(4, wide_costs(), initial_accept_rate=0.0, probe_every=4, max_probe_every=64,
                                suffix_acceptance=SuffixAcceptance(initial=1.0, decay=0.5, pooled_decay=0.5))
    offer = [RowOffer(20, suffix([0.9] * 8))]
    assert ctl.plan(offer, head=False).lengths == [8]
    for _ in range(20):  # confident drafts that are always rejected at once
        plan = ctl.plan(offer, head=False)
        ctl.observe_plan(plan, WIDE[plan.width + 1] if plan.width + 1 in WIDE else 1.5, [0], [offer[0].suffix])
    assert ctl.suffix_acceptance.pooled < 0.1
    plans = []
    for _ in range(200):  # rejected probes back off: one token, ever more rarely
        plan = ctl.plan(offer, head=False)
        plans.append(plan.lengths[0])
        ctl.observe_plan(plan, 1.0, [0], [offer[0].suffix])
    assert set(plans) == {0, 1} and sum(plans) <= 8 and ctl.suffix_probe_every == ctl.max_probe_every
    for _ in range(400):  # then the index's drafts start to be accepted: a probe pays, drafting comes back
        plan = ctl.plan(offer, head=False)
        ctl.observe_plan(plan, 1.0, [plan.lengths[0]], [offer[0].suffix])
    assert ctl.plan(offer, head=False).lengths == [8]


def test_long_own_matches_keep_drafting_while_short_global_ones_stop():
    """Live traffic where the request's own text with a long match is always right and another
    request's 2-token match always wrong: the acceptance model learns it per cell, so one kind of
    failure does not stop the other kind of draft (one scale for both did)."""
    ctl = SpeculationController(0, wide_costs(2), probe_every=10 ** 6)
    good, bad = suffix([1.0] * 12, match_length=30, own=True), suffix([1.0] * 12, match_length=2)
    for _ in range(60):
        plan = ctl.plan([RowOffer(100, good), RowOffer(100, bad)], head=False)
        ctl.observe_plan(plan, ctl.costs._prior(2, plan.rows, 0, 0), [plan.lengths[0], 0], [good, bad])
    plan = ctl.plan([RowOffer(100, good), RowOffer(100, bad)], head=False)
    assert plan.lengths == [12, 0]
    assert min(ctl.suffix_acceptance.probabilities(good)) > 0.95  # one scale for both: 0.5
    assert ctl.suffix_acceptance.probabilities(bad)[0] < 0.5


@pytest.mark.parametrize("length, cell", [(0, 0), (2, 0), (3, 1), (4, 2), (5, 2), (6, 3), (9, 3), (10, 4),
                                          (17, 4), (18, 5), (500, 5)])
def test_match_lengths_fall_in_the_cells_their_bounds_say(length, cell):
    assert match_bucket(length) == cell


def test_suffix_acceptance_counts_only_the_tried_tokens():
    """After a draft's first rejection its tokens were never compared: they count neither way."""
    acceptance = SuffixAcceptance(initial=0.5, shrink=0.0)
    draft = suffix([1.0] * 8, match_length=8, own=True)
    for _ in range(50):
        acceptance.observe(draft, 8, 2)  # two accepted, the third rejected, five never tried
    assert acceptance.scale(True, 8) == pytest.approx(1.0)  # tokens 0 and 1: effective match 8, 9 (cell 6-9)
    assert acceptance.scale(True, 10) == pytest.approx(0.0, abs=1e-9)  # token 2 (cell 10-17), and no later token
    assert acceptance.scale(False, 8) == pytest.approx(acceptance.pooled) == pytest.approx(100 / 150, rel=0.02)
    probabilities = SuffixAcceptance(initial=0.5).probabilities(suffix([1.0, 0.5], match_length=3))
    assert probabilities == [pytest.approx(0.5), pytest.approx(0.25)]
    assert SuffixAcceptance().gains(suffix([1.0, 1.0]), 1) == [0.0, pytest.approx(0.5)]


# ---- the guard: drafting answers to measured tokens per second ---------------------------------

def _run_steps(ctl, offer, n, seconds_of, accepted_of):
    """n planned and observed steps -> the plans; seconds_of(plan), accepted_of(plan) -> per row."""
    plans = []
    for _ in range(n):
        plan = ctl.plan(offer, head=False)
        plans.append(plan)
        ctl.observe_plan(plan, seconds_of(plan), accepted_of(plan), [r.suffix for r in offer])
    return plans


def test_drafting_steps_that_run_slower_than_modelled_stop_drafting():
    """The cost curve says drafting pays, the confidences are honest (half of every draft is
    accepted), but the machine runs drafting steps at a third of the modelled speed: drafting
    must stop after a few steps, though plain steps run exactly as modelled."""
    ctl = trusting(0, wide_costs(2), probe_every=10 ** 6)
    offer = [RowOffer(100, suffix([1.0] * 8)), RowOffer(100, suffix([1.0] * 8))]

    def seconds(plan):  # a plain step costs 1.0 as modelled; a drafting step 3x its model
        return 1.0 if plan.width == 0 else 3.0 * ctl.costs._prior(2, plan.rows, 0, 0)

    def accepted(plan):
        return [n // 2 for n in plan.lengths]

    plans = _run_steps(ctl, offer, 600, seconds, accepted)
    drafted = [p.width > 0 for p in plans]
    assert all(drafted[: ctl.guard.min_steps])  # the model said drafting pays, so it was tried first
    assert not any(drafted[ctl.guard.min_steps: 2 * ctl.guard.min_steps])  # then plain steps to compare with
    assert sum(drafted[100:]) <= 8  # and drafting stopped: the drafting steps' own cost scale says 3x
    assert ctl.costs.scale[(2, SUFFIX)] == pytest.approx(3.0) and ctl.costs.scale[(2, NONE)] == pytest.approx(1.0)


def test_drafting_that_measures_faster_is_never_paused():
    """Drafting steps run as modelled and pay: only the plain reference steps interrupt them."""
    ctl = trusting(0, wide_costs(2), probe_every=10 ** 6)
    offer = [RowOffer(100, suffix([1.0] * 8)), RowOffer(100, suffix([1.0] * 8))]
    plans = _run_steps(ctl, offer, 400, lambda plan: ctl.costs._prior(2, plan.rows, 0, 0),
                       lambda plan: [n // 2 for n in plan.lengths])
    plain = sum(p.width == 0 for p in plans)
    guard = ctl.guard
    assert 0 < plain <= guard.min_steps + 400 // guard.refresh_every + 1
    assert not guard._paused_until and guard.rate(2, SUFFIX) > guard.rate(2, NONE)


def test_the_guard_pauses_one_batch_size_not_the_others():
    guard = SpeculationController(0, wide_costs()).guard
    for _ in range(guard.min_steps):
        guard.observe(4, NONE, 4, 1.0)  # plain at B=4: 4 tokens/s
    for _ in range(guard.min_steps):
        guard.observe(4, SUFFIX, 5, 2.0)  # drafting at B=4: 2.5 tokens/s
    assert not guard.allows(4, SUFFIX) and guard.allows(1, SUFFIX) and guard.allows(8, SUFFIX)
    assert guard.rate(4, SUFFIX) is None  # the next trial is judged on fresh steps
    for _ in range(guard.min_pause):
        guard.observe(1, NONE, 1, 1.0)
    assert guard.allows(4, SUFFIX)
    guard.observe(4, NONE, 4, 1.0)  # the plain reference stays fresh
    for _ in range(guard.min_steps):  # a trial that loses again: a pause twice as long
        guard.observe(4, SUFFIX, 5, 2.0)
    assert not guard.allows(4, SUFFIX)
    for _ in range(guard.min_pause):
        guard.observe(1, NONE, 1, 1.0)
    assert not guard.allows(4, SUFFIX)
    for _ in range(guard.min_pause):
        guard.observe(1, NONE, 1, 1.0)
    guard.observe(4, NONE, 4, 1.0)
    assert guard.allows(4, SUFFIX)
    for _ in range(guard.min_steps):  # a trial that wins: drafting goes on, the pause is reset
        guard.observe(4, SUFFIX, 12, 2.0)
    assert guard.allows(4, SUFFIX) and guard._pause[(4, SUFFIX)] == guard.min_pause


def test_stale_plain_timing_asks_for_one_plain_reference_step():
    guard = SpeculationController(0, wide_costs()).guard
    for _ in range(guard.min_steps):
        guard.observe(2, SUFFIX, 6, 1.0)
    assert not guard.allows(2, SUFFIX)  # drafting measured, nothing to compare with: plain steps first
    for _ in range(guard.min_steps):
        guard.observe(2, NONE, 2, 1.0)
    assert guard.allows(2, SUFFIX)
    for _ in range(guard.refresh_every):
        guard.observe(2, SUFFIX, 6, 1.0)
    assert not guard.allows(2, SUFFIX)  # the plain timing is old now: one step refreshes it
    assert not guard.allows(2, HEAD)  # and the head does not take that step instead
    guard.observe(2, NONE, 2, 1.0)
    assert guard.allows(2, SUFFIX) and guard.allows(2, HEAD)


def test_a_proposer_measured_slower_than_plain_is_left_out_and_the_other_goes_on():
    """The model says the head pays on a row without a suffix draft, but the head's steps measured
    0.6 tokens/s against plain steps' 1.0 while the index's steps made 3.1: the head pauses at B=1
    (its rows run plain), the index keeps drafting, and B=2 is judged apart."""
    ctl = trusting(4, wide_costs(), initial_accept_rate=0.8, probe_every=10 ** 6)
    bare, matched = RowOffer(100), RowOffer(100, suffix([1.0] * 8))
    assert ctl.plan([bare], head=True).proposers == [HEAD]  # the model alone: the head pays
    guard = ctl.guard
    for _ in range(guard.min_steps):
        guard.observe(1, NONE, 1, 1.0)
    for _ in range(guard.min_steps):
        guard.observe(1, SUFFIX, 5, 1.6)
    for _ in range(guard.min_steps):
        guard.observe(1, HEAD, 3, 4.8)
    assert not guard.allows(1, HEAD) and guard.allows(1, SUFFIX) and guard.allows(2, HEAD)
    assert ctl.plan([bare], head=True).width == 0
    plan = ctl.plan([matched], head=True)
    assert plan.proposers == [SUFFIX] and plan.lengths == [8]
    assert ctl.plan([bare, bare], head=True).head_k > 0


def test_the_head_pauses_where_its_steps_lose_to_the_same_plans_without_it():
    """The head's steps carry the index's rows too: they beat plain steps (1.5 against 1.0
    tokens/s) while the same plans made without the head yielded 2.0: the head pauses at B=2 and
    the index drafts on. At B=1 a head beating both references is not paused."""
    guard = SpeculationController(4, wide_costs()).guard
    for kind, tokens in ((NONE, 2), (WITHOUT_HEAD, 4), (HEAD, 3)):
        for _ in range(guard.min_steps):
            guard.observe(2, kind, tokens, 2.0)
    assert not guard.allows(2, HEAD) and guard.allows(2, SUFFIX)
    for kind, tokens in ((NONE, 1), (WITHOUT_HEAD, 2), (HEAD, 5)):
        for _ in range(guard.min_steps):
            guard.observe(1, kind, tokens, 2.0)
    assert guard.allows(1, HEAD) and (1, HEAD) not in guard._paused_until


def test_now_and_then_a_plan_that_gives_the_head_rows_is_made_without_it():
    """Once the head has drafted min_steps steps at B=2, the next plan that would give it rows is
    made without it (the index keeps its row) and filed as the head's reference, until the
    reference has min_steps steps; no probe rides on a reference step."""
    ctl = trusting(4, wide_costs(), initial_accept_rate=0.8, probe_every=1)
    offer = [RowOffer(100), RowOffer(100, suffix([1.0] * 2))]
    first = ctl.plan(offer, head=True)
    assert first.proposers == [HEAD, SUFFIX] and not first.probe
    guard = ctl.guard
    for kind in (NONE, HEAD):
        for _ in range(guard.min_steps):
            guard.observe(2, kind, 4, 1.0)
    for _ in range(guard.min_steps):
        plan = ctl.plan(offer, head=True)
        assert plan.head_reference and plan.proposers == [NONE, SUFFIX] and plan.guard_kind == WITHOUT_HEAD
        assert not plan.probe and plan.kind == SUFFIX  # the cost scales file it by what ran
        ctl.observe_plan(plan, 1.0, [0, 2], [r.suffix for r in offer])
    assert guard.rate(2, WITHOUT_HEAD) == pytest.approx(4.0)
    plan = ctl.plan(offer, head=True)
    assert plan.proposers == [HEAD, SUFFIX] and not plan.head_reference


def test_a_head_that_costs_more_than_it_adds_beside_the_index_stops_drafting():
    """The model says the head pays on the row the index has no draft for, and every draft is
    accepted. One head step in four takes 4x its modelled time (a long catch-up; the cost scale is a median and does not see it),
    so the head's steps still beat plain ones but lose to the same steps without the head: the
    head stops drafting at that batch size and the index goes on."""
    ctl = trusting(4, wide_costs(), initial_accept_rate=0.6, probe_every=10 ** 6)
    offer = [RowOffer(100), RowOffer(100, suffix([1.0] * 2))]
    assert ctl.plan(offer, head=True).proposers == [HEAD, SUFFIX]
    head_steps = itertools.count()

    def seconds(plan):
        modelled = ctl.costs._prior(2, plan.rows, plan.head_k, len(plan.rows_of(HEAD)))
        return modelled * (4.0 if plan.head_k and next(head_steps) % 4 == 3 else 1.0)

    def accepted(plan):  # every draft is accepted whole
        return list(plan.lengths)

    plans, measured = [], {}
    for _ in range(400):
        plan = ctl.plan(offer, head=True)
        took, emitted = seconds(plan), accepted(plan)
        ctl.observe_plan(plan, took, emitted, [r.suffix for r in offer])
        plans.append(plan)
        tokens, total = measured.get(plan.guard_kind, (0, 0.0))
        measured[plan.guard_kind] = (tokens + 2 + sum(emitted), total + took)
    rate = {kind: tokens / total for kind, (tokens, total) in measured.items()}
    assert rate[NONE] < rate[HEAD] < rate[WITHOUT_HEAD]
    assert (2, HEAD) in ctl.guard._paused_until and (2, SUFFIX) not in ctl.guard._paused_until
    assert sum(HEAD in p.proposers for p in plans[200:]) <= 2 * ctl.guard.min_steps
    assert sum(p.proposers[1] == SUFFIX for p in plans[200:]) >= 150


def test_a_step_is_filed_under_the_head_when_the_head_drafted_for_any_row():
    assert StepPlan(3, 2, [2, 3, 0], [HEAD, SUFFIX, NONE]).kind == HEAD
    assert StepPlan(3, 0, [0, 3], [NONE, SUFFIX]).kind == SUFFIX
    assert StepPlan.plain(3).kind == NONE


# ---- the calibrated prior --------------------------------------------------------------------

def test_a_prior_point_timed_below_a_smaller_forward_is_raised_to_it():
    timed = {(1, 1): 14.1, (1, 2): 15.9, (1, 3): 15.2, (1, 5): 16.0,
             (4, 1): 13.0, (4, 2): 18.0, (4, 3): 17.0, (4, 5): 25.0}
    prior = _non_decreasing(timed)
    assert prior == {(1, 1): 14.1, (1, 2): 15.9, (1, 3): 15.9, (1, 5): 16.0,
                     (4, 1): 14.1, (4, 2): 18.0, (4, 3): 18.0, (4, 5): 25.0}
    assert _non_decreasing(prior) == prior

