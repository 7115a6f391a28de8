import pytest
import torch

from specrl.trainer.objectives import drafter_loss, forward_kl, policy_gradient, rejected_penalty

EMPTY = torch.zeros(0, dtype=torch.long)


def test_forward_kl_is_zero_at_the_target_and_positive_elsewhere():
    target = torch.randn(5, 11)
    assert forward_kl(target.clone(), target) == pytest.approx(0.0, abs=1e-6)
    assert forward_kl(torch.randn(5, 11), target) > 0


def test_kl_gradient_moves_q_towards_p():
    target = torch.randn(3, 7) * 3
    draft = torch.zeros(3, 7, requires_grad=True)
    opt = torch.optim.SGD([draft], lr=1.0)
    before = forward_kl(draft, target).item()
    for _ in range(50):
        opt.zero_grad()
        forward_kl(draft, target).backward()
        opt.step()
    assert forward_kl(draft, target).item() < 0.1 * before


def test_rejected_penalty_pushes_the_rejected_token_down():
    draft = torch.zeros(2, 5, requires_grad=True)
    loss = rejected_penalty(draft, torch.tensor([1]), torch.tensor([3]))
    loss.backward()
    assert draft.grad[1, 3] > 0 and (draft.grad[1, [0, 1, 2, 4]] < 0).all() and (draft.grad[0] == 0).all()
    assert rejected_penalty(draft, EMPTY, EMPTY).item() == 0


def test_policy_gradient_raises_tokens_with_above_average_return():
    draft = torch.zeros(2, 4, requires_grad=True)
    loss = policy_gradient(draft, torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 0]))
    loss.backward()
    assert draft.grad[0, 2] < 0 and draft.grad[1, 3] > 0  # gradient descent raises row 0's token


def test_unknown_objective():
    with pytest.raises(ValueError, match="kl, kl_neg, pg"):
        drafter_loss("mse", torch.zeros(1, 2), torch.zeros(1, 2), rejected_rows=EMPTY, rejected_tokens=EMPTY,
                     step_rows=EMPTY, step_tokens=EMPTY, step_returns=EMPTY)
