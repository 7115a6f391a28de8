"""The vLLM backend's draft length per batch size (serving/vllm/build.py), from a cost profile."""

import pytest

from specrl.serving.vllm.build import accept_rate_of, draft_schedule, drafts_anywhere
from specrl.speculation.controller import CostModel, expected_tokens


def costs(verify_growth_b8: float) -> CostModel:
    """B = 1: a flat curve (verifying 5 positions costs 1.1x one); B = 8: each position costs more."""
    target = {(1, t): 1.0 + 0.025 * (t - 1) for t in range(1, 6)}
    target.update({(8, t): 1.5 * (1 + verify_growth_b8 * (t - 1)) for t in range(1, 6)})
    return CostModel(target=target, draft={1: 0.05, 8: 0.08})


def test_a_good_drafter_drafts_where_verifying_is_cheap_and_stops_where_it_is_not():
    schedule = draft_schedule(costs(0.5), accept_rate=0.6, max_batch=8, max_k=4)
    assert schedule[0][0] == 1 and schedule[-1][1] == 8  # every batch size has an entry
    assert all(a[1] + 1 == b[0] for a, b in zip(schedule, schedule[1:]))  # contiguous, no overlap
    k_at = {b: k for lo, hi, k in schedule for b in range(lo, hi + 1)}
    assert k_at[1] >= 2 and k_at[8] < k_at[1]


def test_an_untrained_drafter_does_not_draft_at_all():
    """...and so gets no speculative config: vLLM would run its layer on every token for nothing."""
    schedule = draft_schedule(costs(0.5), accept_rate=0.05, max_batch=8, max_k=4)
    assert schedule == [(1, 8, 0)] and not drafts_anywhere(schedule)
    assert drafts_anywhere(draft_schedule(costs(0.5), accept_rate=0.6, max_batch=8, max_k=4))


@pytest.mark.parametrize("a", [0.0, 0.1, 0.35, 0.8])
def test_accept_rate_inverts_expected_tokens(a):
    assert accept_rate_of(expected_tokens(a, 4), 4) == pytest.approx(a, abs=1e-6)
