"""On a CUDA GPU (marker `gpu`, not run in CI): the compiled Triton kernels at realistic shapes
against their twins, the dispatch choosing them, and the full-size statistical test.
Run with the rest of the kernel tests: `pytest tests/kernels -m "gpu or not gpu"`; the other
kernel tests then also run the compiled kernels on the GPU (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from specrl.apps.bench.kernels import loss_inputs, verify_inputs
from specrl.kernels import fused_drafter_loss, rejection_sample, rejection_sample_torch
from specrl.kernels import drafter_loss as twin
from tests.kernels.conftest import accept_probs, accepted_law, assert_follows, make_case, trial_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("shape", [(64, 8, 49152), (256, 4, 131072), (3, 1, 5)])
def test_verification_kernel_equals_twin(triton_kernels, shape):
    args = verify_inputs(*shape, CUDA)
    kernel = triton_kernels["verify"].rejection_sample_triton(*args)
    expected = rejection_sample_torch(*args)
    assert torch.equal(kernel[0], expected[0])
    assert torch.equal(kernel[1], expected[1])
    dispatched = rejection_sample(*args)  # on CUDA the dispatch runs the kernel
    assert torch.equal(dispatched[1], kernel[1])


def test_verification_kernel_follows_the_target_20k_trials(triton_kernels):
    p, q = make_case("random", 3, seed=80)
    drafts, qs, ps, u = (t.to(CUDA) for t in trial_inputs(p, q, 20_000, seed=81))
    accepted, emitted = triton_kernels["verify"].rejection_sample_triton(
        drafts, qs, ps, u, torch.zeros(20_000, dtype=torch.bool, device=CUDA))
    accepted, emitted = accepted.cpu(), emitted.cpu()
    for i in range(4):
        rows = accepted >= i
        assert_follows(emitted[rows, i], p[i], f"position {i + 1}")
    assert_follows(accepted, torch.from_numpy(accepted_law(accept_probs(p, q))), "accepted count")


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_loss_kernels_equal_twin(triton_kernels, dtype, rtol):
    hidden, weight, target, rows, tokens = loss_inputs(2048, 1024, 49152, dtype, CUDA)
    results = []
    for fn in (triton_kernels["loss"].drafter_loss_triton, twin.drafter_loss, fused_drafter_loss):
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, target, rows, tokens, 0.5)
        loss.backward()
        results.append((loss.detach().float(), hidden.grad.float(), weight.grad.float()))
    for got, want in zip(results[0], results[1]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))
    for got, want in zip(results[2], results[0]):  # the dispatch used the kernels
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))
