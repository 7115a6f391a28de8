"""Speculative decoding is exact: greedy output equals plain greedy decoding token for token,
and sampled output follows the target's distribution."""

import pytest
from scipy.stats import chi2_contingency

from specrl.spec.sampling import SamplingParams
from tests.engine.conftest import chat_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("fixed_k", [1, 3, -1])  # -1: the adaptive controller
def test_greedy_speculation_equals_plain_greedy_tiny(make_engine, tokenizer, fixed_k):
    prompts = chat_prompts(tokenizer, 10)
    plain = make_engine(drafter="none", max_batch=4).generate(prompts, GREEDY)
    spec_engine = make_engine(max_batch=4, fixed_draft_tokens=fixed_k, max_draft_tokens=4)
    spec = spec_engine.generate(prompts, GREEDY)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    if fixed_k > 0:  # the speculative path really ran, and accepted some drafts
        assert sum(c.drafted for c in spec) > 0 and sum(c.accepted for c in spec) > 0


@pytest.mark.slow
def test_greedy_speculation_equals_plain_greedy_smollm2(make_engine, tokenizer):
    prompts = chat_prompts(tokenizer, 8)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = make_engine(model="smollm2-135m", drafter="none", max_batch=4).generate(prompts, params)
    spec = make_engine(model="smollm2-135m", max_batch=4, fixed_draft_tokens=4).generate(prompts, params)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert sum(c.drafted for c in spec) > 0


def test_sampled_tokens_follow_the_target_distribution(make_engine, tokenizer):
    """The token drawn by the verify step (accepted draft or recovered token) has the same
    distribution with and without speculation: two-sample chi-square, reject at p < 1e-3.
    top_p keeps the support small enough for the test to have power."""
    [prompt] = chat_prompts(tokenizer, 1)
    n = 1500
    params = [SamplingParams(max_tokens=3, temperature=0.5, top_p=0.05, seed=i, ignore_eos=True) for i in range(n)]
    spec_engine = make_engine(max_batch=8, fixed_draft_tokens=1)
    spec = spec_engine.generate([prompt] * n, params)
    plain = make_engine(drafter="none", max_batch=8).generate([prompt] * n, [p.__class__(**{**p.__dict__, "seed": p.seed + n}) for p in params])
    accepted = sum(c.accepted for c in spec)
    assert 0 < accepted < sum(c.drafted for c in spec), "both accept and reject paths must be exercised"
    pairs_spec = [tuple(c.output_ids[:2]) for c in spec]
    pairs_plain = [tuple(c.output_ids[:2]) for c in plain]
    support = sorted(set(pairs_spec) | set(pairs_plain))
    common = [p for p in support if pairs_spec.count(p) + pairs_plain.count(p) >= 10]
    table = [[pairs_spec.count(p) for p in common], [pairs_plain.count(p) for p in common]]
    assert len(common) >= 3
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)
