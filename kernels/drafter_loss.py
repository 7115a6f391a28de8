"""Fused drafter loss: forward KL to the target plus the negative term on rejected drafts, computed
from the drafter's hidden states and output head, chunked over the vocabulary so the [N, V] draft
logits never exist whole. This file holds the torch twin of each kernel, the math shared by both
implementations, the autograd wrapper, and the materialised reference; the Triton kernels are in
drafter_loss_triton.py (model: Liger-Kernel's fused linear cross-entropy / Cut Cross-Entropy).

Math. x [N, H] is the head's input (the drafter's hidden states after its final norm), W [V, H]
the head (V = the draft vocabulary), z = x W^T [N, V] the draft logits, q = softmax(z);
t [N, V] the target logits over the same vocabulary, p = softmax(t) (t = -inf means p = 0).
(rows n_r, ids d_r), r = 1..R, are the rejected drafts; lambda = neg_weight; c = 1 - 1e-6.

    loss = 1/N sum_n KL(p_n || q_n)  +  lambda/R sum_r -log(1 - min(q_{n_r}(d_r), c))   (2nd term 0 if R = 0)
    KL_n = sum_x p(x) (t(x) - z(x)) - lse(t_n) + lse(z_n)

Gradient, with G = dL/dloss, a_r = lambda/R * q_r / (1 - q_r) (0 where q_r > c, as torch.clamp
gives) and s_n = sum over r with n_r = n of a_r:

    g = dloss/dz:  g[n, x] = G (q[n, x] (1/N - s_n) - p[n, x] / N) + G sum_{r: n_r = n, d_r = x} a_r
    d hidden = g W [N, H],  d weight = g^T x [V, H]

Split into two kernels (each with a twin here of the same signature) and shared torch code:
- row_stats: lse(z_n), lse(t_n), KL_n (and argmax z_n) for every row, online over vocabulary chunks (running max
  and sum of exp for z and for t, and S = sum e^{t - m_t} (t - z), rescaled when m_t grows);
- dense_grads: recompute z tile by tile, form the dense part of g and accumulate dx and dW;
- negative_term / add_sparse_grads: the R rejected pairs need only z at (n_r, d_r), an R x H dot
  product: computed outside the kernels. 1 - q_r is computed as -expm1(z - lse), except when d_r
  is the row's argmax (the only way q_r can be near 1), where 1 - q = (s - 1) / s with
  s = sum_x e^{z_x - max z} from row_stats: z_d then comes from the same tiles as lse, so
  -log(1 - q) keeps float32 resolution near saturation, as with materialised logits.
Cost: 4 [N, V, H] matmuls (z once forward, z again plus two for the gradient) against 3 for the
materialised loss, which in exchange holds [N, V] logits, softmaxes and gradients.
Inputs are assumed valid: `specrl.kernels.fused_drafter_loss` checks them first.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

NEG_CLAMP = 1 - 1e-6  # as trainer/objectives.py: q(d) is clamped below 1 before log(1 - q)
BLOCK_N = 2048  # twin chunks: [2048, 8192] float32 = 64 MiB per temporary
BLOCK_V = 8192
PAIR_BLOCK = 4096  # rejected pairs per gathered [pairs, H] temporary


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 inputs (gradcheck) compute in float64, everything else in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    """A running max with -inf replaced by the lowest finite value, so exp(t - m) and exp(m_old - m)
    are 0 (not NaN) while a row has seen only -inf."""
    return m.clamp(min=torch.finfo(m.dtype).min)


class RowStats(NamedTuple):
    """Per-row results of row_stats, each [N] (float32; float64 for float64 inputs; top int64)."""

    lse_q: torch.Tensor  # logsumexp_x z[n, x]
    lse_t: torch.Tensor  # logsumexp_x t[n, x]
    kl: torch.Tensor  # KL(p_n || q_n)
    top: torch.Tensor  # argmax_x z[n, x] (first index on ties)
    top_rest: torch.Tensor  # 1 - q_n(top) = (s - 1) / s, s = sum_x e^{z[n, x] - max z[n]}


def row_stats(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
              block_n: int | None = None, block_v: int | None = None) -> RowStats:
    """Torch twin of `drafter_loss_triton.row_stats`.

    hidden [N, H] float, weight [V, H] float (same dtype), target_logits [N, V] float.
    Returns RowStats (see there) for z = x W^T, computed over [block_n, block_v] chunks with an
    online logsumexp; z and softmax(z) never exist beyond one chunk.
    """
    cdt = compute_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    bn, bv = block_n or BLOCK_N, block_v or BLOCK_V
    out = torch.empty(5, n, dtype=cdt, device=hidden.device)
    top = torch.zeros(n, dtype=torch.long, device=hidden.device)
    for r0 in range(0, n, bn):
        x = hidden[r0:r0 + bn].to(cdt)
        m_z = torch.full((x.shape[0],), float("-inf"), dtype=cdt, device=x.device)
        m_t, s_z, s_t, acc = m_z.clone(), torch.zeros_like(m_z), torch.zeros_like(m_z), torch.zeros_like(m_z)
        for c0 in range(0, v, bv):
            z = x @ weight[c0:c0 + bv].to(cdt).T
            t = target_logits[r0:r0 + bn, c0:c0 + bv].to(cdt)
            chunk_max, chunk_top = z.max(1)
            top[r0:r0 + bn] = torch.where(chunk_max > m_z, c0 + chunk_top, top[r0:r0 + bn])
            new = torch.maximum(m_z, chunk_max)
            s_z = s_z * torch.exp(m_z - new) + torch.exp(z - new[:, None]).sum(1)
            m_z = new
            new = _safe_max(torch.maximum(m_t, t.amax(1)))
            scale, e = torch.exp(m_t - new), torch.exp(t - new[:, None])
            s_t = s_t * scale + e.sum(1)
            acc = acc * scale + torch.where(e > 0, e * (t - z), 0).sum(1)
            m_t = new
        lse_q, lse_t = m_z + s_z.log(), m_t + s_t.log()
        out[:, r0:r0 + bn] = torch.stack([lse_q, lse_t, acc / s_t - lse_t + lse_q, m_z, (s_z - 1) / s_z])
    return RowStats(out[0], out[1], out[2], top, out[4])


def dense_grads(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor, lse_q: torch.Tensor,
                lse_t: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, need_hidden: bool, need_weight: bool,
                block_n: int | None = None, block_v: int | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Torch twin of `drafter_loss_triton.dense_grads`.

    hidden [N, H], weight [V, H], target_logits [N, V] float; lse_q, lse_t [N] from row_stats;
    alpha, beta [N] (compute dtype). With g[n, x] = alpha_n q[n, x] - beta_n p[n, x], returns
    (g W [N, H] if need_hidden, g^T x [V, H] if need_weight), in the compute dtype, accumulated
    over [block_n, block_v] tiles of z = x W^T that are recomputed, never stored whole.
    """
    cdt = compute_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    bn, bv = block_n or BLOCK_N, block_v or BLOCK_V
    grad_x = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_hidden else None
    grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_weight else None
    for r0 in range(0, n, bn):
        x = hidden[r0:r0 + bn].to(cdt)
        rows = slice(r0, r0 + bn)
        for c0 in range(0, v, bv):
            w = weight[c0:c0 + bv].to(cdt)
            z = x @ w.T
            p = torch.exp(target_logits[rows, c0:c0 + bv].to(cdt) - lse_t[rows, None])
            g = torch.exp(z - lse_q[rows, None]) * alpha[rows, None] - p * beta[rows, None]
            if grad_x is not None:
                grad_x[rows] += g @ w
            if grad_w is not None:
                grad_w[c0:c0 + bv] += g.T @ x
    return grad_x, grad_w


# ---- shared by both implementations ------------------------------------------------------------

def negative_term(hidden: torch.Tensor, weight: torch.Tensor, rejected_rows: torch.Tensor,
                  rejected_tokens: torch.Tensor, stats: RowStats, neg_weight: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (lambda/R sum_r -log(1 - min(q_r, c)) [] , a [R] = lambda/R q_r/(1 - q_r), 0 where q_r > c);
    both 0 when R = 0 or lambda = 0. 1 - q_r: see the module docstring."""
    cdt = compute_dtype(hidden)
    r = rejected_rows.numel()
    if r == 0 or neg_weight == 0:
        return torch.zeros((), dtype=cdt, device=hidden.device), torch.zeros(r, dtype=cdt, device=hidden.device)
    z = torch.cat([(hidden[rejected_rows[i:i + PAIR_BLOCK]].to(cdt) * weight[rejected_tokens[i:i + PAIR_BLOCK]].to(cdt))
                   .sum(-1) for i in range(0, r, PAIR_BLOCK)])
    rest = torch.where(stats.top[rejected_rows] == rejected_tokens, stats.top_rest[rejected_rows],
                       -torch.expm1(z - stats.lse_q[rejected_rows]))  # 1 - q_r
    floor = 1 - torch.tensor(NEG_CLAMP, dtype=cdt, device=hidden.device)  # 1 - c as the compute dtype rounds c
    term = -torch.log(rest.clamp(min=floor)).sum() * (neg_weight / r)
    coeff = torch.where(rest >= floor, (1 - rest) / rest.clamp(min=floor), 0) * (neg_weight / r)
    return term, coeff


def add_sparse_grads(grad_x: torch.Tensor | None, grad_w: torch.Tensor | None, hidden: torch.Tensor,
                     weight: torch.Tensor, rejected_rows: torch.Tensor, rejected_tokens: torch.Tensor,
                     coeff: torch.Tensor) -> None:
    """The +a_r at (n_r, d_r) part of g: grad_x[n_r] += a_r W[d_r], grad_w[d_r] += a_r x[n_r] (in place)."""
    cdt = coeff.dtype
    for i in range(0, coeff.numel(), PAIR_BLOCK):
        rows, tokens, a = (rejected_rows[i:i + PAIR_BLOCK], rejected_tokens[i:i + PAIR_BLOCK],
                           coeff[i:i + PAIR_BLOCK, None])
        if grad_x is not None:
            grad_x.index_add_(0, rows, a * weight[tokens].to(cdt))
        if grad_w is not None:
            grad_w.index_add_(0, tokens, a * hidden[rows].to(cdt))


class FusedDrafterLoss(torch.autograd.Function):
    """loss [] = the module docstring's loss; backward gives d hidden and d weight (none for
    target_logits: the target is frozen). `impl` is a module with row_stats and dense_grads: this
    one (the twin) or drafter_loss_triton."""

    @staticmethod
    def forward(ctx, hidden, weight, target_logits, rejected_rows, rejected_tokens, neg_weight, impl, block_n,
                block_v):
        stats = impl.row_stats(hidden, weight, target_logits, block_n, block_v)
        neg, coeff = negative_term(hidden, weight, rejected_rows, rejected_tokens, stats, neg_weight)
        ctx.save_for_backward(hidden, weight, target_logits, rejected_rows, rejected_tokens, stats.lse_q, stats.lse_t,
                              coeff)
        ctx.impl, ctx.blocks = impl, (block_n, block_v)
        return stats.kl.mean() + neg

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target_logits, rows, tokens, lse_q, lse_t, coeff = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return (None,) * 9
        n = hidden.shape[0]
        grad = grad_loss.to(lse_q.dtype)
        s = torch.zeros_like(lse_q).index_add_(0, rows, coeff)
        alpha = grad * (1.0 / n - s)
        beta = (grad / n).expand(n).contiguous()
        grad_x, grad_w = ctx.impl.dense_grads(hidden, weight, target_logits, lse_q, lse_t, alpha, beta, need_x, need_w,
                                              *ctx.blocks)
        add_sparse_grads(grad_x, grad_w, hidden, weight, rows, tokens, grad * coeff)
        return (grad_x.to(hidden.dtype) if need_x else None, grad_w.to(weight.dtype) if need_w else None,
                None, None, None, None, None, None, None)


def drafter_loss(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                 rejected_rows: torch.Tensor, rejected_tokens: torch.Tensor, neg_weight: float = 0.0,
                 impl: ModuleType | None = None, block_n: int | None = None,
                 block_v: int | None = None) -> torch.Tensor:
    """The fused loss with autograd, no input checks (see `specrl.kernels.fused_drafter_loss`).
    impl: this module (the twin, default) or drafter_loss_triton."""
    return FusedDrafterLoss.apply(hidden, weight, target_logits, rejected_rows, rejected_tokens, float(neg_weight),
                                  impl or sys.modules[__name__], block_n, block_v)


def drafter_loss_reference(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                           rejected_rows: torch.Tensor, rejected_tokens: torch.Tensor,
                           neg_weight: float = 0.0) -> torch.Tensor:
    """The same loss with the [N, V] logits materialised and plain autograd (tests and benchmark).
    Same formulas as trainer/objectives.py (forward_kl + neg_weight * rejected_penalty), except that
    p = 0 entries (t = -inf) contribute 0 rather than NaN."""
    cdt = compute_dtype(hidden)
    log_q = F.log_softmax(hidden.to(cdt) @ weight.to(cdt).T, -1)
    log_p = F.log_softmax(target_logits.to(cdt), -1)
    p = log_p.exp()
    loss = torch.where(p > 0, p * (log_p - log_q), 0).sum(-1).mean()
    if rejected_rows.numel() and neg_weight:
        q = log_q[rejected_rows, rejected_tokens].exp()
        loss = loss + neg_weight * -torch.log1p(-q.clamp(max=NEG_CLAMP)).mean()
    return loss
