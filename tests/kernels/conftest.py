"""Kernel tests: shared cases, and the Triton kernels run through Triton's interpreter on CPU.

Without a CUDA device the Triton kernels can only run interpreted (launching one fails with
"0 active drivers" unless TRITON_INTERPRET=1), and triton decides that when a @triton.jit function is decorated, i.e. when a kernel
module is imported. So TRITON_INTERPRET=1 is set here, when pytest loads this file during
collection, before any test runs; nothing in specrl imports a kernel module on CPU tensors, and
the `triton_kernels` fixture re-imports one that was somehow imported before. On a machine with
CUDA the variable is left alone and the same tests run the compiled kernels on the GPU.
Interpreted kernels are 20-100x slower: keep their shapes tiny.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ALPHA = 1e-3  # chi-square tests fail when the p-value falls below this
V = 7
TRITON_MODULES = ("specrl.kernels.verify_triton", "specrl.kernels.drafter_loss_triton")


@pytest.fixture(scope="session")
def triton_kernels():
    """-> {"verify": verify_triton, "loss": drafter_loss_triton}, interpreted on CPU (skipped,
    with the reason, when triton is not installed)."""
    pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]' (see pyproject.toml)")
    modules = [importlib.import_module(name) for name in TRITON_MODULES]
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for i, module in enumerate(modules):
            kernels = [k for k in vars(module).values() if isinstance(k, (JITFunction, InterpretedFunction))]
            if not all(isinstance(k, InterpretedFunction) for k in kernels):
                modules[i] = importlib.reload(module)  # imported before TRITON_INTERPRET was set
            kernels = [k for k in vars(modules[i]).values() if isinstance(k, (JITFunction, InterpretedFunction))]
            assert kernels and all(isinstance(k, InterpretedFunction) for k in kernels), \
                f"{module.__name__}: kernels not interpreted although TRITON_INTERPRET=1"
    return dict(zip(("verify", "loss"), modules))


# ---- distributions and cases for verification --------------------------------------------------

def assert_follows(samples: torch.Tensor, probs: torch.Tensor, what: str = "") -> None:
    """samples [N] int64 follow the (possibly unnormalised) distribution probs [V] (chi-square,
    p-value > ALPHA); tokens with zero probability never appear."""
    assert samples.numel() > 0, what
    p = probs.double().cpu().numpy()
    p = p / p.sum()
    counts = np.bincount(samples.cpu().numpy(), minlength=len(p))
    assert len(counts) == len(p), f"{what}: out-of-range ids {samples.max()}"
    assert counts[p == 0].sum() == 0, f"{what}: emitted a zero-probability token: {counts} vs {p}"
    obs, exp = counts[p > 0].astype(float), samples.numel() * p[p > 0]
    if len(obs) < 2:
        return
    small = exp < 5
    if small.any():  # pool rare bins so the chi-square approximation holds
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    pvalue = chisquare(obs, exp).pvalue
    assert pvalue > ALPHA, f"{what}: chi-square p={pvalue:.2e}, counts {obs} vs expected {exp.round(1)}"


def dirichlet(n: int, v: int, g: torch.Generator, alpha: float = 2.0) -> torch.Tensor:
    x = torch._standard_gamma(torch.full((n, v), alpha, dtype=torch.float64), generator=g)
    return x / x.sum(-1, keepdim=True)


def normalise(x: torch.Tensor) -> torch.Tensor:
    return (x / x.sum(-1, keepdim=True)).float()


def make_case(case: str, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> target p [K+1, V] float32, draft q [K, V] float32."""
    g = torch.Generator().manual_seed(seed)
    p = dirichlet(k + 1, V, g)
    q = dirichlet(k, V, g)
    if case == "random":
        pass
    elif case == "q_mass_where_p_has_none":  # p never emits tokens 0, 1; q likes them
        p[:, :2] = 0
        q[:, :2] += 0.5
    elif case == "q_misses_p_support":  # q never drafts tokens 5, 6; only the residual can emit them
        q[:, 5:] = 0
        p[:, 5:] += 0.3
    elif case == "q_equals_p":
        q = p[:k].clone()
    elif case == "disjoint":  # nothing can be accepted
        p[:, :3] = 0
        q[:, 3:] = 0
    else:
        raise AssertionError(case)
    return normalise(p), normalise(q)


CASES = ["random", "q_mass_where_p_has_none", "q_misses_p_support", "q_equals_p", "disjoint"]


def trial_inputs(p: torch.Tensor, q: torch.Tensor, n: int, seed: int):
    """n independent verification steps sharing p [K+1, V] and q [K, V]: drafts d_i ~ q_i, seeded
    uniforms -> (drafts [n, K], q [n, K, V], p [n, K+1, V], uniforms [n, K+1])."""
    k, v = q.shape[0], p.shape[1]
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1) \
        if k else torch.zeros(n, 0, dtype=torch.long)
    uniforms = torch.rand(n, k + 1, generator=g)
    return drafts, q.expand(n, k, v).contiguous(), p.expand(n, k + 1, v).contiguous(), uniforms


def accept_probs(p: torch.Tensor, q: torch.Tensor) -> list[float]:
    """Per-position acceptance alpha_i = sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i)."""
    return [float(torch.minimum(p[i].double(), q[i].double()).sum()) for i in range(q.shape[0])]


def accepted_law(alphas: list[float]) -> np.ndarray:
    """P(accepted = j), j = 0..K: the first j positions accepted, position j+1 rejected (or j = K)."""
    law, prefix = [], 1.0
    for a in alphas:
        law.append(prefix * (1 - a))
        prefix *= a
    law.append(prefix)
    return np.array(law)


def greedy_batch(bsz: int, k: int, v: int, seed: int):
    """Random targets and drafts whose first mismatch with argmax is at a chosen position m (m = K: none).
    -> p [B, K+1, V], drafts [B, K], mismatch [B], expected emitted [B, K+1]."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(bsz, k + 1, v, generator=g) * 3, -1)
    top = p.argmax(-1)
    mismatch = torch.arange(bsz) % (k + 1)
    drafts = torch.randint(0, v, (bsz, k), generator=g)
    for b in range(bsz):
        m = int(mismatch[b])
        drafts[b, :m] = top[b, :m]
        if m < k:
            drafts[b, m] = (top[b, m] + 1 + torch.randint(0, v - 1, (1,), generator=g)) % v  # != argmax
    expected = torch.full((bsz, k + 1), -1, dtype=torch.long)
    for b in range(bsz):
        m = int(mismatch[b])
        expected[b, :m + 1] = top[b, :m + 1]
    return p, drafts, mismatch, expected


def mixed_batch(bsz: int, k: int, v: int, seed: int, ragged: bool = True):
    """A batch mixing greedy and sampled rows, rows drafting from the target itself (accepting a
    lot), greedy rows with matching prefixes and, if ragged, per-row draft lengths with -1 padding.
    -> (drafts [B, K], q [B, K, V], p [B, K+1, V], uniforms [B, K+1], greedy [B], lens [B] | None)."""
    g = torch.Generator().manual_seed(seed)
    p = normalise(dirichlet(bsz * (k + 1), v, g, alpha=0.7).view(bsz, k + 1, v))
    q = normalise(dirichlet(bsz * k, v, g, alpha=0.7).view(bsz, k, v))
    q[::3] = p[::3, :k]
    drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(bsz, k)
    drafts[1::4, :2] = p[1::4, :2].argmax(-1)
    uniforms = torch.rand(bsz, k + 1, generator=g)
    greedy = torch.rand(bsz, generator=g) < 0.3
    lens = None
    if ragged:
        lens = torch.randint(0, k + 1, (bsz,), generator=g)
        lens[:2] = torch.tensor([0, k])
        drafts = torch.where(torch.arange(k)[None, :] < lens[:, None], drafts, -1)
    return drafts, q, p, uniforms, greedy, lens


# ---- inputs for the drafter loss ---------------------------------------------------------------

def make_inputs(n=37, h=24, v=45, r=15, seed=60, dtype=torch.float64, masked=True, saturated=False):
    """-> hidden [N, H], weight [V, H], target_logits [N, V] (some -inf), rejected rows/ids [R]
    (repeats included: a row may have several rejected drafts)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    target = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    if masked:
        target[3, :v // 4] = float("-inf")
        target[5, v // 2:] = float("-inf")
    rows = torch.randint(0, n, (r,), generator=g)
    tokens = torch.randint(0, v, (r,), generator=g)
    if saturated:  # row rows[0] puts all its mass on tokens[0]: q > 1 - 1e-6, the clamp's zero-gradient side
        hidden[rows[0]] = weight[tokens[0]] * 40
    return hidden.to(dtype), weight.to(dtype), target.to(dtype), rows, tokens


def loss_and_grads(fn, hidden, weight, target, rows, tokens, neg_weight, grad_weight=True, **kw):
    """-> (loss, d hidden, d weight or None) of 1.7 * fn(...) (an upstream gradient != 1)."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_(grad_weight)
    loss = fn(hidden, weight, target, rows, tokens, neg_weight, **kw)
    (1.7 * loss).backward()
    return loss.detach(), hidden.grad, weight.grad


def assert_all_close(got, want, rtol, atol):
    for name, a, b in zip(("loss", "d hidden", "d weight"), got, want):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
