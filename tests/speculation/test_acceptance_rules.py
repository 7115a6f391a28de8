"""The acceptance rules of a verify step (specrl/speculation/verify.py) with the suffix index's drafts
(q one-hot at the most voted token, or a draw from the vote distribution): every emitted token
follows the target, under rejection sampling and under the coupled rule of seeded rows, also when
the target's distributions are processed (penalties counting the drafts before each position,
top_k, min_p). Chi-square goodness of fit against p, reject at p < 1e-3."""

import pytest
import torch
from scipy.stats import chisquare

from specrl.speculation.propose import Draft, assemble
from specrl.speculation.sampling import RowSampler, SamplingParams
from specrl.speculation.suffix_index import SuffixDraft, _draw
from specrl.speculation.verify import accept

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


@pytest.mark.parametrize("votes", [{0: 3, 1: 3, 2: 2}, {5: 1, 4: 1}, {3: 2, 0: 1, 2: 1}])
def test_drafts_drawn_from_the_votes_emit_the_target_distribution(votes):
    """A sampled suffix draft: d_1 drawn from the vote distribution v (as SuffixIndex.propose draws
    it), assembled into q = v, verified by rejection sampling: the first token follows p_1, d_1 is
    accepted with probability sum_x min(p_1(x), v(x)), the bonus follows p_2."""
    gen = torch.Generator().manual_seed(11)
    ids, total = list(votes), sum(votes.values())
    shares = [c / total for c in votes.values()]
    draws = torch.rand(N, generator=gen).tolist()
    drafts = [SuffixDraft([tok := _draw(votes, u * total)], [votes[tok] / total], 4, True, [(ids, shares)])
              for u in draws]
    draft = assemble(1, [1] * N, [], None, drafts, V, with_probs=True)
    v = torch.zeros(V)
    v[ids] = torch.tensor(shares)
    assert torch.equal(draft.probs[:, 0], v.expand(N, V)) and bool((draft.logprobs[:, 0] <= 0).all())
    assert abs(torch.bincount(draft.tokens[:, 0], minlength=V).double() / N - v.double()).max() < 0.015
    sampler = RowSampler(torch.full((N,), 1.0), torch.ones(N), torch.zeros(N, dtype=torch.bool),
                         [torch.Generator() for _ in range(N)])
    accepted, emitted = accept(draft, P.expand(N, 2, V).contiguous(), torch.rand(N, 2, generator=gen), sampler)
    assert chisquare(torch.bincount(emitted[:, 0], minlength=V).double(), expected(P[0], N)).pvalue > 1e-3
    assert abs(accepted.float().mean() - torch.minimum(P[0], v).sum()) < 0.015
    bonus = emitted[accepted == 1, 1]
    assert chisquare(torch.bincount(bonus, minlength=V).double(), expected(P[1], len(bonus))).pvalue > 1e-3


def test_the_coupled_rule_emits_the_inverse_cdf_token_whatever_the_draft():
    """Reproducibility: under the coupled rule the first token is F^-1(u) for every draft."""
    (_, with_0), uniforms = run(True, 0)
    (_, with_4), _ = run(True, 4)
    cdf = P[0].cumsum(0)
    expected = torch.searchsorted(cdf, uniforms[:, 0] * cdf[-1], right=True).clamp(max=V - 1)
    assert torch.equal(with_0[:, 0], expected) and torch.equal(with_4[:, 0], expected)


# ---- processed distributions: penalties count the drafts a position follows -------------------

LOGITS = torch.tensor([[1.5, 1.0, 0.5, 0.2, -0.3, -1.0],   # position 1 (d_1's)
                       [1.2, 0.4, 1.0, 0.8, -0.5, 0.1]])  # position 2: the bonus after d_1
PENALISED = SamplingParams(temperature=1.0, top_k=4, min_p=0.05, repetition_penalty=1.8, presence_penalty=0.7,
                           frequency_penalty=0.4)


def _by_hand(logits: torch.Tensor, seen: list[int], counts: dict[int, int]) -> torch.Tensor:
    """PENALISED's distribution, written out: penalties on the tokens seen, top_k 4, min_p 0.05."""
    x = logits.clone()
    for token in seen:
        x[token] = x[token] / 1.8 if x[token] > 0 else x[token] * 1.8
    for token, count in counts.items():
        x[token] -= 0.4 * count + 0.7
    p = torch.softmax(x, -1)
    p[p < p.max() * 0.05] = 0
    p[p < p.sort(descending=True).values[3]] = 0
    return p / p.sum()


@pytest.mark.parametrize("coupled", [False, True])
def test_a_penalised_bonus_follows_the_distribution_that_counts_the_accepted_draft(coupled):
    """Prompt [2], nothing generated yet, d_1 = 0 (one-hot). Position 1's distribution counts the
    prompt only; position 2's counts d_1 as generated (repetition, frequency and presence penalties),
    as plain decoding would after emitting it. Chi-square against the distributions written out by
    hand, reject at p < 1e-3; and the bonus is far from the distribution that forgets d_1."""
    sampler = RowSampler.of([PENALISED], [torch.Generator()], history=[([2], [])])
    draft_tokens = torch.zeros(1, 1, dtype=torch.long)
    probs = sampler.probs(LOGITS[None], draft_tokens).expand(N, 2, V).contiguous()
    first, second = _by_hand(LOGITS[0], [2], {}), _by_hand(LOGITS[1], [2, 0], {0: 1})
    torch.testing.assert_close(probs[0], torch.stack([first, second]))
    uniforms = torch.rand(N, 2, generator=torch.Generator().manual_seed(11))
    one_hot = torch.zeros(N, 1, V).scatter_(-1, torch.zeros(N, 1, 1, dtype=torch.long), 1.0)
    draft = Draft(draft_tokens.expand(N, 1), one_hot, torch.zeros(N, 1), torch.ones(N, dtype=torch.long))
    rows = RowSampler(torch.ones(N), torch.ones(N), torch.zeros(N, dtype=torch.bool),
                      [torch.Generator() for _ in range(N)], [torch.zeros(1)] * N if coupled else None)
    accepted, emitted = accept(draft, probs, uniforms, rows)
    assert fit(torch.bincount(emitted[:, 0], minlength=V).double(), first) > 1e-3
    bonus = torch.bincount(emitted[accepted == 1, 1], minlength=V).double()
    assert fit(bonus, second) > 1e-3
    assert fit(bonus, _by_hand(LOGITS[1], [2], {})) < 1e-6  # the distribution that forgets d_1 is rejected


def fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value of counts [V] against p [V]; 0 when a token with p = 0 came out."""
    if counts[p == 0].sum() > 0:
        return 0.0
    return float(chisquare(counts[p > 0], expected(p[p > 0], int(counts.sum()))).pvalue)


def test_greedy_rows_verify_against_the_argmax_after_penalties():
    """Raw argmax at position 1 is token 0; repetition_penalty 3 on the prompt's token 0 moves it
    to token 1: a draft of 0 is rejected and 1 emitted, as plain greedy decoding would."""
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    sampler = RowSampler.of([params], [torch.Generator()], history=[([0], [])])
    draft = Draft(torch.tensor([[0]]), None, torch.zeros(1, 1), torch.ones(1, dtype=torch.long))
    accepted, emitted = accept(draft, sampler.probs(LOGITS[None], draft.tokens), torch.rand(1, 2), sampler)
    assert accepted.tolist() == [0] and emitted[0, 0] == 1
    plain = RowSampler.of([SamplingParams(temperature=0.0)], [torch.Generator()])
    accepted, emitted = accept(draft, plain.probs(LOGITS[None], draft.tokens), torch.rand(1, 2), plain)
    assert accepted.tolist() == [1] and emitted[0, 1] == 0  # without the penalty: accepted, then token 0 again
