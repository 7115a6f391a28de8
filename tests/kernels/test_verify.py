"""Rejection sampling, the dispatch and its torch twin (kernels/verify.py): statistical tests for
sampled rows, exactness for greedy rows, ragged draft lengths.

Statistical tests use fixed seeds and a chi-square goodness-of-fit test; a test fails when the
p-value falls below ALPHA = 1e-3 (bins with expected count < 5 are pooled). Seeded, so the
outcome is deterministic; the bound says how surprising a pass/fail would be by chance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specrl.kernels import inverse_cdf_sample, rejection_sample, rejection_sample_rowwise, rejection_sample_torch
from tests.kernels.conftest import (CASES, V, accept_probs, accepted_law, assert_follows, greedy_batch, make_case,
                                    mixed_batch, normalise, trial_inputs)

TRIALS = 20_000


def run_trials(p: torch.Tensor, q: torch.Tensor, n: int = TRIALS, seed: int = 1, greedy: bool = False):
    """n independent verification steps sharing p and q: drafts d_i ~ q_i, seeded uniforms."""
    drafts, qs, ps, uniforms = trial_inputs(p, q, n, seed)
    accepted, emitted = rejection_sample(drafts, qs, ps, uniforms, torch.full((n,), greedy))
    return drafts, accepted, emitted


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_emitted_tokens_follow_the_target(case, k):
    p, q = make_case(case, k)
    drafts, accepted, emitted = run_trials(p, q)
    # Position 1 follows p_1 whatever happened; position i+1, given the first i drafts were
    # accepted, follows p_{i+1} (a later draft, a recovered token, or the bonus).
    assert_follows(emitted[:, 0], p[0], f"{case} position 1")
    reach = np.cumprod(accept_probs(p, q))
    for i in range(1, k + 1):
        rows = accepted >= i
        if reach[i - 1] == 0:  # e.g. disjoint supports: no row gets that far
            assert not bool(rows.any())
            continue
        assert_follows(emitted[rows, i], p[i], f"{case} position {i + 1} given {i} accepted")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_accepted_count_follows_one_minus_tv(case, k):
    p, q = make_case(case, k)
    _, accepted, _ = run_trials(p, q, seed=2)
    alphas = accept_probs(p, q)
    law = accepted_law(alphas)
    assert_follows(accepted, torch.from_numpy(law), f"{case} accepted count")
    # First position alone: a binomial with success probability sum_x min(p_1, q_1).
    n, a1 = accepted.numel(), alphas[0]
    hits = int((accepted >= 1).sum())
    assert abs(hits - n * a1) <= 4.5 * math.sqrt(n * a1 * (1 - a1)) + 1e-9, (hits, n * a1)  # |z| <= 4.5
    # Mean accepted = sum_i prod_{j<=i} alpha_j, within 4.5 standard errors of the exact law.
    mean = float((np.arange(k + 1) * law).sum())
    sd = math.sqrt(float((np.arange(k + 1) ** 2 * law).sum()) - mean ** 2)
    assert abs(float(accepted.double().mean()) - mean) <= 4.5 * sd / math.sqrt(n) + 1e-9


def test_edge_cases_of_acceptance_are_exact():
    _, acc_equal, _ = run_trials(*make_case("q_equals_p", 3), n=2000)
    _, acc_disjoint, _ = run_trials(*make_case("disjoint", 3), n=2000)
    assert bool((acc_equal == 3).all()), "q == p must accept every draft"
    assert bool((acc_disjoint == 0).all()), "disjoint supports can accept nothing"


@pytest.mark.parametrize("case", ["random", "q_mass_where_p_has_none"])
def test_layout_of_emitted(case):
    p, q = make_case(case, 3)
    drafts, accepted, emitted = run_trials(p, q, n=4000, seed=3)
    assert accepted.dtype == torch.long and emitted.dtype == torch.long
    assert emitted.shape == (4000, 4)
    assert bool(((accepted >= 0) & (accepted <= 3)).all())
    pos = torch.arange(4)[None, :]
    before = pos < accepted[:, None]
    assert torch.equal(emitted[before], drafts[before[:, :3]]), "accepted prefix must be the drafts"
    assert bool((emitted[pos > accepted[:, None]] == -1).all()), "beyond accepted+1 must be -1"
    last = emitted.gather(1, accepted[:, None]).squeeze(1)
    assert bool((last >= 0).all())
    # Never a token the target gives zero probability at its position.
    assert bool((p[accepted, last] > 0).all())


def test_matches_row_by_row_reference():
    drafts, q, p, u, greedy, _ = mixed_batch(96, 4, 10, seed=5, ragged=False)
    accepted, emitted = rejection_sample(drafts, q, p, u, greedy)
    ref_acc, ref_emit = rejection_sample_rowwise(drafts, q, p, u, greedy)
    assert torch.equal(accepted, ref_acc)
    assert torch.equal(emitted, ref_emit)
    assert int(accepted.max()) == 4 and int(accepted.min()) == 0  # the test covers both ends


def test_acceptance_threshold_is_p_over_q():
    # one row per case, K = 1, V = 4; draft token 2 everywhere.
    p = torch.tensor([[[0.25, 0.25, 0.25, 0.25]] * 2] * 4)
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]] * 4)
    q[3, 0] = torch.tensor([0.25, 0.5, 0.125, 0.125])  # q(d) < p(d): always accepted
    p[2, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # p(d) == 0: never accepted, even at u = 0
    drafts = torch.full((4, 1), 2)
    u = torch.tensor([[0.49, 0.5], [0.51, 0.5], [0.0, 0.5], [1 - 2 ** -24, 0.5]])
    accepted, _ = rejection_sample(drafts, q, p, u, torch.zeros(4, dtype=torch.bool))
    assert accepted.tolist() == [1, 0, 0, 1]


# ---- greedy ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_reproduce_greedy_decoding(with_draft_probs):
    bsz, k, v = 40, 4, 9
    p, drafts, mismatch, expected = greedy_batch(bsz, k, v, seed=7)
    g = torch.Generator().manual_seed(8)
    # Greedy rows must ignore the draft distributions and the uniforms entirely.
    q = normalise(torch.rand(bsz, k, v, generator=g).double()) if with_draft_probs else None
    u = torch.rand(bsz, k + 1, generator=g)
    accepted, emitted = rejection_sample(drafts, q, p, u, torch.ones(bsz, dtype=torch.bool))
    assert torch.equal(accepted, mismatch)
    assert torch.equal(emitted, expected)


def test_mixed_batch_greedy_rows_exact_and_sampled_rows_unaffected():
    bsz, k, v = 40, 3, 9
    p, drafts, mismatch, expected = greedy_batch(bsz, k, v, seed=11)
    g = torch.Generator().manual_seed(12)
    q = normalise(torch.rand(bsz, k, v, generator=g).double())
    u = torch.rand(bsz, k + 1, generator=g)
    greedy = torch.arange(bsz) % 2 == 0
    accepted, emitted = rejection_sample(drafts, q, p, u, greedy)
    assert torch.equal(accepted[greedy], mismatch[greedy])
    assert torch.equal(emitted[greedy], expected[greedy])
    s = ~greedy  # sampled rows give the same answer as in a batch of their own
    acc_alone, emit_alone = rejection_sample(drafts[s], q[s], p[s], u[s], torch.zeros(int(s.sum()), dtype=torch.bool))
    assert torch.equal(accepted[s], acc_alone)
    assert torch.equal(emitted[s], emit_alone)


def test_all_greedy_without_draft_probs_matches_with_them():
    bsz, k, v = 30, 3, 8
    p, drafts, mismatch, expected = greedy_batch(bsz, k, v, seed=13)
    u = torch.rand(bsz, k + 1)
    greedy = torch.ones(bsz, dtype=torch.bool)
    a0, e0 = rejection_sample(drafts, None, p, u, greedy)
    a1, e1 = rejection_sample(drafts, normalise(torch.rand(bsz, k, v).double()), p, u, greedy)
    assert torch.equal(a0, mismatch) and torch.equal(e0, expected)
    assert torch.equal(a0, a1) and torch.equal(e0, e1)


# ---- K = 0 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("empty_probs", [False, True])
def test_k0_samples_one_token_from_the_target(empty_probs):
    p, _ = make_case("q_mass_where_p_has_none", 1)
    p1 = p[:1]  # [1, V]
    g = torch.Generator().manual_seed(21)
    n = TRIALS
    q = torch.zeros(n, 0, V) if empty_probs else None
    accepted, emitted = rejection_sample(torch.zeros(n, 0, dtype=torch.long), q, p1.expand(n, 1, V),
                                         torch.rand(n, 1, generator=g), torch.zeros(n, dtype=torch.bool))
    assert emitted.shape == (n, 1)
    assert bool((accepted == 0).all())
    assert_follows(emitted[:, 0], p1[0], "K=0 sampled")


def test_k0_greedy_is_argmax():
    g = torch.Generator().manual_seed(22)
    p = torch.softmax(torch.randn(50, 1, V, generator=g), -1)
    accepted, emitted = rejection_sample(torch.zeros(50, 0, dtype=torch.long), None, p,
                                         torch.rand(50, 1, generator=g), torch.ones(50, dtype=torch.bool))
    assert bool((accepted == 0).all())
    assert torch.equal(emitted[:, 0], p[:, 0].argmax(-1))


# ---- inverse_cdf_sample ------------------------------------------------------------------------

NEAR_ONE = [1 - 2 ** -24, 1 - 2 ** -23, 1 - 1e-6, 0.9999]


def test_inverse_cdf_intervals_are_exact():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.25, 0.5, 0.0])  # dyadic: the cdf is exact
    u = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 0.75, 1 - 2 ** -24])
    out = inverse_cdf_sample(probs.expand(len(u), 6), u)
    assert out.tolist() == [1, 1, 3, 3, 4, 4, 4]
    # Unnormalised probabilities scale the same intervals.
    assert inverse_cdf_sample((3 * probs).expand(len(u), 6), u).tolist() == [1, 1, 3, 3, 4, 4, 4]


@pytest.mark.parametrize("scale", [1.0, 0.3, 1e-3, 7.0])
def test_inverse_cdf_never_draws_a_zero_probability_token(scale):
    g = torch.Generator().manual_seed(31)
    rows, v = 3000, 8
    probs = torch.rand(rows, v, generator=g) * (torch.rand(rows, v, generator=g) < 0.4)
    probs[:, 0] = 0  # leading zero
    probs[:, -1] = 0  # trailing zero
    probs[torch.arange(rows), 1 + torch.randint(0, v - 2, (rows,), generator=g)] += 1e-3  # >= 1 positive
    probs[0] = torch.tensor([0, 0, 0, 0, 0, 0, 1.0, 0])  # single positive, before a trailing zero
    probs[1] = torch.tensor([0, 1.0, 1e-30, 0, 0, 0, 0, 0])  # tiny mass after the bulk
    probs = probs * scale
    edge = torch.tensor([0.0, *NEAR_ONE])
    u = torch.cat([edge.repeat(rows // len(edge) + 1)[:rows][:, None], torch.rand(rows, 3, generator=g)], 1)
    for col in range(u.shape[1]):
        ids = inverse_cdf_sample(probs, u[:, col])
        assert ids.dtype == torch.long
        chosen = probs[torch.arange(rows), ids]
        assert bool((chosen > 0).all()), f"zero-probability token drawn for u={u[chosen == 0, col][:5].tolist()}"


def test_inverse_cdf_matches_the_distribution():
    probs = torch.tensor([0.0, 0.1, 0.3, 0.0, 0.05, 0.35, 0.2, 0.0]) * 0.7  # unnormalised, with zeros
    g = torch.Generator().manual_seed(32)
    u = torch.rand(TRIALS, generator=g)
    assert_follows(inverse_cdf_sample(probs.expand(TRIALS, 8), u), probs, "inverse cdf")


def test_inverse_cdf_keeps_leading_dimensions():
    g = torch.Generator().manual_seed(33)
    probs = torch.rand(4, 5, 6, generator=g)
    u = torch.rand(4, 5, generator=g)
    ids = inverse_cdf_sample(probs, u)
    assert ids.shape == (4, 5)
    assert torch.equal(ids.view(-1), inverse_cdf_sample(probs.view(20, 6), u.view(20)))


# ---- ragged draft lengths (draft_lens) ---------------------------------------------------------

@pytest.mark.parametrize("seed", [40, 41])
def test_ragged_batch_matches_row_by_row_reference(seed):
    drafts, q, p, u, greedy, lens = mixed_batch(96, 5, 11, seed=seed)
    ref_acc, ref_emit = rejection_sample_rowwise(drafts, q, p, u, greedy, lens)
    for fn in (rejection_sample, rejection_sample_torch):
        accepted, emitted = fn(drafts, q, p, u, greedy, lens)
        assert torch.equal(accepted, ref_acc), fn.__name__
        assert torch.equal(emitted, ref_emit), fn.__name__
    assert bool((ref_acc <= lens).all())
    assert bool(((ref_acc == lens) & (lens > 0)).any()) and bool((ref_acc < lens).any())  # both endings covered


def test_padded_row_equals_the_row_alone():
    drafts, q, p, u, greedy, lens = mixed_batch(40, 4, 9, seed=43)
    accepted, emitted = rejection_sample(drafts, q, p, u, greedy, lens)
    for b, length in enumerate(lens.tolist()):
        one = slice(b, b + 1)
        alone = rejection_sample(drafts[one, :length], q[one, :length], p[one, :length + 1], u[one, :length + 1],
                                 greedy[one])
        assert int(alone[0]) == int(accepted[b])
        assert torch.equal(alone[1][0], emitted[b, :length + 1])
        assert bool((emitted[b, length + 1:] == -1).all())


def test_padding_is_never_read():
    drafts, q, p, u, greedy, lens = mixed_batch(60, 4, 9, seed=44)
    expected = rejection_sample(drafts, q, p, u, greedy, lens)
    pos = torch.arange(5)[None, :]
    p = p.masked_fill((pos > lens[:, None])[..., None], float("nan"))
    q = q.masked_fill((pos[:, :4] >= lens[:, None])[..., None], float("nan"))
    u = u.masked_fill(pos > lens[:, None], float("nan"))
    drafts = torch.where(pos[:, :4] < lens[:, None], drafts, 10 ** 6)
    for fn in (rejection_sample, rejection_sample_torch, rejection_sample_rowwise):
        accepted, emitted = fn(drafts, q, p, u, greedy, lens)
        assert torch.equal(accepted, expected[0]) and torch.equal(emitted, expected[1]), fn.__name__


def test_ragged_rows_follow_the_target():
    p, q = make_case("random", 3, seed=45)
    drafts, qs, ps, uniforms = trial_inputs(p, q, TRIALS, seed=46)
    lens = torch.randint(0, 4, (TRIALS,), generator=torch.Generator().manual_seed(47))
    accepted, emitted = rejection_sample(drafts, qs, ps, uniforms, torch.zeros(TRIALS, dtype=torch.bool), lens)
    assert bool((accepted <= lens).all())
    assert_follows(emitted[:, 0], p[0], "ragged position 1")
    for i in (1, 2, 3):
        assert_follows(emitted[accepted >= i, i], p[i], f"ragged position {i + 1} given {i} accepted")
    # Each length's accepted count follows the law of its own first L positions.
    alphas = accept_probs(p, q)
    for length in range(4):
        assert_follows(accepted[lens == length], torch.from_numpy(accepted_law(alphas[:length])),
                       f"accepted count at L={length}")
