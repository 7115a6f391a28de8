"""The fused drafter loss's Triton kernels (kernels/drafter_loss_triton.py) against the torch twin.

On CPU the kernels run in Triton's interpreter (conftest.py): tiny shapes, tiles of 16 or 32 so
that rows, vocabulary and H all span several tiles with a partial last one, and the vocabulary is
split in 2 slices (the merge is exercised). Tolerances, float32 (sums in another order, float32
atomics for the gradients): row statistics and loss rtol 1e-5, atol 1e-6; gradients rtol 1e-4,
atol 1e-6. The argmax per row must be equal.
"""

from __future__ import annotations

import pytest
import torch

from specrl.kernels import drafter_loss as twin
from tests.kernels.conftest import DEVICE, assert_all_close, loss_and_grads, make_inputs


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32)])
def test_row_stats_equal_the_twin(triton_kernels, blocks):
    hidden, weight, target, _, _ = on_device(*make_inputs(n=37, h=40, v=45, dtype=torch.float32))
    got = triton_kernels["loss"].row_stats(hidden, weight, target, *blocks)
    want = twin.row_stats(hidden, weight, target)
    for name in ("lse_q", "lse_t", "kl", "top_rest"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(got.top, want.top)


@pytest.mark.parametrize("case", ["plain", "saturated", "frozen_head", "no_rejections"])
def test_loss_and_gradients_equal_the_twin(triton_kernels, case):
    hidden, weight, target, rows, tokens = on_device(*make_inputs(dtype=torch.float32, saturated=case == "saturated"))
    if case == "no_rejections":
        rows, tokens = rows[:0], tokens[:0]
    frozen = case == "frozen_head"
    got = loss_and_grads(triton_kernels["loss"].drafter_loss_triton, hidden, weight, target, rows, tokens, 0.5,
                         grad_weight=not frozen, block_n=16, block_v=16)
    want = loss_and_grads(twin.drafter_loss, hidden, weight, target, rows, tokens, 0.5, grad_weight=not frozen)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert_all_close(got, want, rtol=1e-4, atol=1e-6)
