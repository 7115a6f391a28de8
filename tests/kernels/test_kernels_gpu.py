"""On a CUDA GPU (marker `gpu`, not run in CI): the compiled Triton kernels at realistic shapes
against their twins, the dispatch's choice (the verification kernel; the loss's twin), and the
full-size statistical test.
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
    assert_same_draws(args, kernel, rejection_sample_torch(*args))
    dispatched = rejection_sample(*args)  # on CUDA the dispatch runs the kernel
    assert torch.equal(dispatched[1], kernel[1])


def assert_same_draws(args, kernel, twin, tol: float = 1e-5) -> None:
    """The kernel's accepted counts and tokens equal the twin's, except a sampled row's last token
    where the two float32 cdfs (the kernel's chunked scan, torch's cumsum) round differently near
    u * total: then each of the two tokens has weight and brackets u * total in the float64 cdf to
    within tol * total, and such rows are rare (at V = 131072 up to 6 of 256 rows seen on an H200)."""
    drafts, q, p, u, greedy = args
    k = drafts.shape[1]
    assert torch.equal(kernel[0], twin[0])
    differ = (kernel[1] != twin[1]).any(-1).nonzero().squeeze(1).tolist()
    assert len(differ) <= max(1, len(greedy) // 25), f"{len(differ)} of {len(greedy)} rows differ"
    for b in differ:
        a = int(kernel[0][b])
        assert not bool(greedy[b]) and torch.equal(kernel[1][b, :a], twin[1][b, :a])
        w = p[b, a].double()
        if a < k and bool(((w - q[b, a].double()).clamp(min=0) > 0).any()):
            w = (w - q[b, a].double()).clamp(min=0)
        cdf = w.cumsum(0)
        total = float(cdf[-1])
        target = float(u[b, k]) * total
        for x in (int(kernel[1][b, a]), int(twin[1][b, a])):
            below = float(cdf[x - 1]) if x else 0.0
            assert w[x] > 0 and below - tol * total <= target <= float(cdf[x]) + tol * total, \
                f"row {b}: token {x} brackets [{below / total:.8f}, {float(cdf[x]) / total:.8f}], u = {target / total:.8f}"


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


BF16_D_HIDDEN = pytest.mark.xfail(strict=True, reason="known: the bfloat16 kernel's d hidden is off by about its own "
                                  "size on an H200 (drafter_loss_triton.py); the dispatch runs the twin")


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), pytest.param(torch.bfloat16, 3e-2, marks=BF16_D_HIDDEN)])
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
    for got, want in zip(results[2], results[1]):  # the dispatch ran the twin (faster on an H200)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
