"""The fused drafter loss, torch twin (kernels/drafter_loss.py), through the dispatch.

Reference: the same loss with the [N, V] logits materialised and plain autograd
(drafter_loss_reference), itself checked against trainer/objectives.py. Tolerances:
- float64 twin vs float64 reference: rtol 1e-9 (the same math, summed in another order);
- float32 twin vs float64 reference: loss and gradients rtol 1e-4, atol 1e-6 (float32 rounding
  of logits ~10 and of sums over V);
- bfloat16 inputs (computed in float32) vs the reference on the same bfloat16 values: rtol 1e-3.
torch.autograd.gradcheck (float64, finite differences) checks the hand-written backward.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from specrl.kernels import drafter_loss_reference, fused_drafter_loss
from specrl.kernels import drafter_loss as twin
from tests.kernels.conftest import assert_all_close, loss_and_grads, make_inputs


@pytest.mark.parametrize("neg_weight", [0.0, 0.5])
@pytest.mark.parametrize("blocks", [(None, None), (8, 16), (5, 7)])
def test_twin_float64_equals_the_materialised_reference(neg_weight, blocks):
    inputs = make_inputs()
    ref = loss_and_grads(drafter_loss_reference, *inputs, neg_weight)
    got = loss_and_grads(twin.drafter_loss, *inputs, neg_weight, block_n=blocks[0], block_v=blocks[1])
    assert_all_close(got, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["plain", "saturated", "frozen_head", "no_rejections"])
def test_twin_float32_close_to_the_float64_reference(case):
    hidden, weight, target, rows, tokens = make_inputs(saturated=case == "saturated")
    if case == "no_rejections":
        rows, tokens = rows[:0], tokens[:0]
    frozen = case == "frozen_head"
    ref = loss_and_grads(drafter_loss_reference, hidden, weight, target, rows, tokens, 0.5, grad_weight=not frozen)
    got = loss_and_grads(twin.drafter_loss, hidden.float(), weight.float(), target.float(), rows, tokens, 0.5,
                         grad_weight=not frozen, block_n=8, block_v=16)
    assert got[0].dtype == torch.float32
    assert_all_close(got, ref, rtol=1e-4, atol=1e-6)


def test_twin_bfloat16_inputs():
    hidden, weight, target, rows, tokens = (x.to(torch.bfloat16) if x.is_floating_point() else x for x in make_inputs())
    ref = loss_and_grads(drafter_loss_reference, hidden, weight, target, rows, tokens, 0.5)
    got = loss_and_grads(twin.drafter_loss, hidden, weight, target, rows, tokens, 0.5, block_n=8, block_v=16)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    assert_all_close(got, ref, rtol=1e-3, atol=1e-3)


def test_gradcheck_float64():
    hidden, weight, target, rows, tokens = make_inputs(n=6, h=4, v=7, r=5, seed=61)
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: twin.drafter_loss(x, w, target, rows, tokens, 0.5, block_n=2,
                                                                   block_v=3), (hidden, weight))


def test_dispatch_on_cpu_is_the_twin_with_autograd():
    hidden, weight, target, rows, tokens = make_inputs(dtype=torch.float32)
    got = loss_and_grads(fused_drafter_loss, hidden, weight, target, rows, tokens, 0.5)
    want = loss_and_grads(twin.drafter_loss, hidden, weight, target, rows, tokens, 0.5)
    assert_all_close(got, want, rtol=0, atol=0)
    # No rejections given at all: the KL term alone.
    kl_only = fused_drafter_loss(hidden, weight, target)
    torch.testing.assert_close(kl_only, drafter_loss_reference(hidden, weight, target, rows[:0], tokens[:0]))


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any torch op allocates (views of existing tensors excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def test_twin_never_materialises_the_logits():
    n, h, v, bn, bv = 64, 8, 512, 16, 64
    hidden, weight, target, rows, tokens = make_inputs(n=n, h=h, v=v, r=20, dtype=torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    with _LargestOutput() as mode:
        twin.drafter_loss(hidden, weight, target, rows, tokens, 0.5, block_n=bn, block_v=bv).backward()
    assert mode.largest <= max(bn * bv, v * h, n * h) < n * v, mode.largest
    with _LargestOutput() as mode:
        drafter_loss_reference(hidden, weight, target, rows, tokens, 0.5).backward()
    assert mode.largest >= n * v  # the reference does (what the test would catch)
