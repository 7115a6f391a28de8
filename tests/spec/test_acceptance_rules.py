"""The acceptance rules of a verify step (specrl/spec/verify.py) with deterministic drafts (the
suffix index's: q one-hot): every emitted token follows the target, under rejection sampling and
under the coupled rule of seeded rows. Chi-square goodness of fit against p, reject at p < 1e-3."""

import pytest
import torch
from scipy.stats import chisquare

from specrl.spec.propose import Draft
from specrl.spec.sampling import RowSampler
from specrl.spec.verify import accept

N, V = 20_000, 6
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03],   # position 1: the draft d_1 = 0 is likely
                  [0.05, 0.10, 0.20, 0.30, 0.25, 0.10]])  # position 2 (the bonus after an accepted d_1)


def expected(p: torch.Tensor, n: int) -> torch.Tensor:
    """Expected counts summing to n exactly (chisquare checks the totals agree)."""
    counts = p.double() / p.double().sum() * n
    return counts * (n / counts.sum())


def run(coupled: bool, draft_token: int = 0):
    gen = torch.Generator().manual_seed(7)
    uniforms = torch.rand(N, 2, generator=gen)
    probs = P.expand(N, 2, V).contiguous()
    tokens = torch.full((N, 1), draft_token)
    one_hot = torch.zeros(N, 1, V).scatter_(-1, tokens[..., None], 1.0)
    draft = Draft(tokens, one_hot, torch.zeros(N, 1), torch.ones(N, dtype=torch.long))
    streams = [torch.zeros(1)] * N if coupled else None  # a stream marks a seeded row
    sampler = RowSampler(torch.full((N,), 1.0), torch.ones(N), torch.zeros(N, dtype=torch.bool),
                         [torch.Generator() for _ in range(N)], streams)
    return accept(draft, probs, uniforms, sampler), uniforms


@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("draft_token", [0, 4])
def test_one_hot_drafts_emit_the_target_distribution(coupled, draft_token):
    (accepted, emitted), _ = run(coupled, draft_token)
    first = torch.bincount(emitted[:, 0], minlength=V).double()
    assert chisquare(first, expected(P[0], N)).pvalue > 1e-3
    assert abs(accepted.float().mean() - P[0, draft_token]) < 0.015  # accepted with probability p(d)
    bonus = emitted[accepted == 1, 1]  # after an accepted draft, the bonus token follows p_2
    assert chisquare(torch.bincount(bonus, minlength=V).double(), expected(P[1], len(bonus))).pvalue > 1e-3


def test_the_coupled_rule_emits_the_inverse_cdf_token_whatever_the_draft():
    """Reproducibility: under the coupled rule the first token is F^-1(u) for every draft."""
    (_, with_0), uniforms = run(True, 0)
    (_, with_4), _ = run(True, 4)
    cdf = P[0].cumsum(0)
    expected = torch.searchsorted(cdf, uniforms[:, 0] * cdf[-1], right=True).clamp(max=V - 1)
    assert torch.equal(with_0[:, 0], expected) and torch.equal(with_4[:, 0], expected)
