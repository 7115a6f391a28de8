"""The Triton verification kernel (kernels/verify_triton.py) against its torch twin.

On CPU the kernel runs in Triton's interpreter (conftest.py), ~5 ms per row: shapes stay tiny
and the statistical test uses 1,500 trials (chi-square, p-value > ALPHA = 1e-3; the twin's own
statistical tests use 20,000). Tokens must equal the twin's exactly. block_v = 16 with V not a
multiple of 16 makes every pass over V span several chunks, the last one partial.
"""

from __future__ import annotations

import pytest
import torch

from specrl.kernels import rejection_sample_rowwise, rejection_sample_torch
from tests.kernels.conftest import (DEVICE, accept_probs, accepted_law, assert_follows, greedy_batch, make_case,
                                    mixed_batch, normalise, trial_inputs)

BLOCK_V = 16


def both(triton_kernels, *args):
    """-> (twin result, kernel result) on DEVICE."""
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    twin = rejection_sample_torch(*args)
    kernel = triton_kernels["verify"].rejection_sample_triton(*args, block_v=BLOCK_V)
    return twin, kernel


def assert_same(twin, kernel):
    assert kernel[0].dtype == torch.long and kernel[1].dtype == torch.long
    assert torch.equal(twin[0], kernel[0]), (twin[0].tolist(), kernel[0].tolist())
    assert torch.equal(twin[1], kernel[1])


@pytest.mark.parametrize("ragged", [False, True])
def test_kernel_equals_twin_on_a_mixed_batch(triton_kernels, ragged):
    drafts, q, p, u, greedy, lens = mixed_batch(40, 4, 37, seed=50, ragged=ragged)
    twin, kernel = both(triton_kernels, drafts, q, p, u, greedy, lens)
    assert_same(twin, kernel)
    assert int(twin[0].max()) == 4 and int(twin[0].min()) == 0


@pytest.mark.parametrize("case", ["q_mass_where_p_has_none", "q_misses_p_support", "q_equals_p", "disjoint"])
def test_kernel_equals_twin_on_edge_distributions(triton_kernels, case):
    p, q = make_case(case, 2, seed=51)
    drafts, qs, ps, u = trial_inputs(p, q, 24, seed=52)
    assert_same(*both(triton_kernels, drafts, qs, ps, u, torch.zeros(24, dtype=torch.bool)))


def test_kernel_equals_twin_without_draft_probs(triton_kernels):
    p, drafts, mismatch, expected = greedy_batch(20, 3, 21, seed=53)
    u = torch.rand(20, 4, generator=torch.Generator().manual_seed(54))
    twin, kernel = both(triton_kernels, drafts, None, p, u, torch.ones(20, dtype=torch.bool))
    assert_same(twin, kernel)
    assert torch.equal(kernel[0].cpu(), mismatch) and torch.equal(kernel[1].cpu(), expected)


@pytest.mark.parametrize("with_probs", [False, True])
def test_kernel_k0_is_plain_decoding(triton_kernels, with_probs):
    g = torch.Generator().manual_seed(55)
    p = normalise(torch.rand(16, 1, 19, generator=g).double() ** 4)
    q = torch.zeros(16, 0, 19) if with_probs else None
    greedy = torch.arange(16) % 2 == 0
    twin, kernel = both(triton_kernels, torch.zeros(16, 0, dtype=torch.long), q, p, torch.rand(16, 1, generator=g),
                        greedy)
    assert_same(twin, kernel)
    assert torch.equal(kernel[1][greedy.to(DEVICE), 0].cpu(), p[greedy, 0].argmax(-1))


def test_kernel_greedy_reproduces_greedy_decoding(triton_kernels):
    p, drafts, _, _ = greedy_batch(24, 4, 23, seed=56)
    p[0, 0, :] = 1 / 23  # all tied: the argmax is the first index
    drafts[0, 0] = 0
    g = torch.Generator().manual_seed(57)
    q = normalise(torch.rand(24, 4, 23, generator=g).double())
    greedy = torch.ones(24, dtype=torch.bool)
    kernel = triton_kernels["verify"].rejection_sample_triton(drafts.to(DEVICE), q.to(DEVICE), p.to(DEVICE),
                                                              torch.rand(24, 5, generator=g).to(DEVICE),
                                                              greedy.to(DEVICE), block_v=BLOCK_V)
    ref = rejection_sample_rowwise(drafts, q, p, torch.rand(24, 5), greedy)  # greedy ignores the uniforms
    assert torch.equal(kernel[0].cpu(), ref[0]) and torch.equal(kernel[1].cpu(), ref[1])
    assert int(kernel[0][0]) >= 1  # the tied row accepted token 0


def test_kernel_tokens_follow_the_target(triton_kernels):
    n, k = 1500, 2
    p, q = make_case("random", k, seed=58)
    drafts, qs, ps, u = trial_inputs(p, q, n, seed=59)
    accepted, emitted = triton_kernels["verify"].rejection_sample_triton(
        drafts.to(DEVICE), qs.to(DEVICE), ps.to(DEVICE), u.to(DEVICE), torch.zeros(n, dtype=torch.bool, device=DEVICE))
    accepted, emitted = accepted.cpu(), emitted.cpu()
    assert_follows(emitted[:, 0], p[0], "kernel position 1")
    assert_follows(emitted[accepted >= 1, 1], p[1], "kernel position 2 given 1 accepted")
    assert_follows(accepted, torch.from_numpy(accepted_law(accept_probs(p, q))), "kernel accepted count")
