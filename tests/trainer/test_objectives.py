"""The drafter objectives (trainer/objectives.py): KL and the negative term through the fused kernel."""

import pytest
import torch

from specrl.kernels import drafter_loss_reference
from specrl.trainer.objectives import NEG_WEIGHT, drafter_loss, policy_gradient

EMPTY = torch.zeros(0, dtype=torch.long)


def loss(objective, head_input, weight, target, rejected=(EMPTY, EMPTY), steps=(EMPTY, EMPTY, EMPTY)):
    return drafter_loss(objective, head_input, weight, target, rejected_rows=rejected[0], rejected_tokens=rejected[1],
                        step_rows=steps[0], step_tokens=steps[1], step_returns=steps[2])


def test_forward_kl_is_zero_at_the_target_and_positive_elsewhere():
    target, identity = torch.randn(5, 11), torch.eye(11)  # head_input @ I.T = the draft logits themselves
    assert loss("kl", target.clone(), identity, target) == pytest.approx(0.0, abs=1e-6)
    assert loss("kl", torch.randn(5, 11), identity, target) > 0


def test_kl_gradient_moves_q_towards_p():
    target = torch.randn(3, 7) * 3
    draft = torch.zeros(3, 7, requires_grad=True)
    opt = torch.optim.SGD([draft], lr=1.0)
    before = loss("kl", draft, torch.eye(7), target).item()
    for _ in range(50):
        opt.zero_grad()
        loss("kl", draft, torch.eye(7), target).backward()
        opt.step()
    assert loss("kl", draft, torch.eye(7), target).item() < 0.1 * before


def test_rejected_penalty_pushes_the_rejected_token_down():
    target = torch.zeros(2, 5)
    draft = torch.zeros(2, 5, requires_grad=True)
    with_penalty = loss("kl_neg", draft, torch.eye(5), target, rejected=(torch.tensor([1]), torch.tensor([3])))
    with_penalty.backward()
    grad = draft.grad  # at q = p the KL term's gradient is 0: what is left is the penalty's
    assert grad[1, 3] > 0 and (grad[1, [0, 1, 2, 4]] < 0).all() and (grad[0].abs() < 1e-7).all()
    assert loss("kl_neg", draft, torch.eye(5), target).item() == pytest.approx(0.0, abs=1e-6)


def test_policy_gradient_raises_tokens_with_above_average_return():
    draft = torch.zeros(2, 4, requires_grad=True)
    policy_gradient(draft, torch.tensor([2, 3]), torch.tensor([4, 0])).backward()
    assert draft.grad[0, 2] < 0 and draft.grad[1, 3] > 0  # gradient descent raises row 0's token


def test_pg_objective_reads_the_step_rows():
    head_input, target = torch.zeros(3, 4, requires_grad=True), torch.zeros(3, 4)
    loss("pg", head_input, torch.eye(4), target, steps=(torch.tensor([0, 2]), torch.tensor([1, 1]),
                                                        torch.tensor([3, 0]))).backward()
    assert head_input.grad[0, 1] < 0 and head_input.grad[2, 1] > 0 and (head_input.grad[1].abs() < 1e-7).all()


def test_unknown_objective():
    with pytest.raises(ValueError, match="kl, kl_neg, pg"):
        loss("mse", torch.zeros(1, 2), torch.eye(2), torch.zeros(1, 2))


def test_kl_neg_is_the_materialised_reference_loss():
    gen = torch.Generator().manual_seed(5)
    head_input, weight, target = torch.randn(6, 4, generator=gen), torch.randn(9, 4, generator=gen), torch.randn(6, 9, generator=gen)
    rows, tokens = torch.tensor([0, 2, 2, 5]), torch.tensor([1, 8, 3, 0])
    expected = drafter_loss_reference(head_input, weight, target, rows, tokens, NEG_WEIGHT)
    torch.testing.assert_close(loss("kl_neg", head_input, weight, target, rejected=(rows, tokens)), expected,
                               rtol=1e-5, atol=1e-6)
