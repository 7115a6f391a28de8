"""The planner's bound (`CostModel.least_head_cost`): skipping head lengths that cannot win changes no plan."""

from __future__ import annotations

import pytest
import torch

from specrl.speculation.controller import CostModel, RowOffer
from tests.speculation.test_controller import suffix, trusting


class _NoBound(CostModel):
    """The same costs with no lower bound: the planner tries every head length."""

    def least_head_cost(self, batch: int, head_k: int) -> float:
        return 1e-300


@pytest.mark.parametrize("seed", range(6))
def test_skipping_head_lengths_by_their_bound_finds_the_same_plan(seed):
    """The planner skips a head length whose best conceivable plan cannot beat the best so far
    (`CostModel.least_head_cost`); over random batches, drafts, acceptance and costs (a drafter
    curve that is not monotone in B included) it returns what trying every length returns."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int = 1) -> list[float]:
        return torch.rand(n, generator=gen).tolist()

    tried = {CostModel: 0, _NoBound: 0}  # head lengths planned in full
    for _ in range(40):
        batches = sorted({1, 2 + int(rand()[0] * 7)})
        target = {}
        for b in batches:
            cost = b * (0.5 + rand()[0])
            for t in (1, 2, 3, 5, 9, 17):
                cost += rand()[0] * 0.3 * b
                target[(b, t)] = cost
        draft = {b: 0.05 + 0.3 * rand()[0] for b in batches}
        batch = batches[-1] if rand()[0] < 0.7 else 1
        rows = [RowOffer(20, suffix(rand(int(rand()[0] * 10)), match_length=1 + int(rand()[0] * 20)))
                if rand()[0] < 0.7 else RowOffer(20, None) for _ in range(batch)]
        accept = rand()[0]
        plans = []
        for model in (CostModel, _NoBound):
            ctl = trusting(4, model(target=dict(target), draft=dict(draft)), initial_accept_rate=accept,
                           probe_every=10 ** 6)
            full = ctl._best_with_head

            def counted(*args, model=model, full=full):
                tried[model] += 1
                return full(*args)

            ctl._best_with_head = counted
            plans.append(ctl.plan(rows, head=True))
        assert plans[0] == plans[1]
    assert tried[CostModel] < tried[_NoBound]  # the bound did skip lengths (else this test checks nothing)


def test_least_head_cost_bounds_every_head_step():
    # a calibrated grid (`CostModel.measure`: non-decreasing in T) and a drafter cheaper at B = 8 than at 1
    costs = CostModel(target={(1, 1): 1.0, (1, 3): 1.5, (1, 5): 1.9, (8, 1): 3.0, (8, 3): 4.0, (8, 5): 6.0},
                      draft={1: 0.3, 8: 0.2})
    for batch in (1, 4, 8):
        for head_k in (1, 2, 4):
            least = costs.least_head_cost(batch, head_k)
            for head_rows in range(1, batch + 1):
                for extra in range(head_k * head_rows, head_k * head_rows + 10):
                    assert least <= costs.verify_cost(batch, batch + extra, head_k, head_rows) + 1e-12
