"""Fused drafter loss: the Triton kernels (twins, math and autograd wrapper: drafter_loss.py).

- row_stats: grid (N / BLOCK_N, S). Program (i, s) owns BLOCK_N rows and the s-th of S slices
  of the vocabulary; per BLOCK_V chunk it computes the z tile with tl.dot over BLOCK_H slices of
  H, then updates the online state per row (m_z, sum e^{z - m_z}, m_t, sum e^{t - m_t},
  S = sum e^{t - m_t} (t - z), argmax z). The S partial states [6, S, N] are merged in torch (a few [S, N]
  ops); S > 1 only to fill the GPU when N is small.
- dense_grads: grid (N / BLOCK_N, V / BLOCK_V). Each program recomputes its z tile, forms
  g = alpha q - beta p in registers, then for every BLOCK_H slice adds g W_slice into d hidden and
  g^T x_slice into d weight with float32 atomics (Cut Cross-Entropy's layout). The order of the
  atomic adds varies run to run: gradients are not bitwise deterministic on a GPU.
Neither kernel writes more than [N, H], [V, H] and [6, S, N] floats. tl.dot takes bfloat16/float16
inputs as they are (float32 accumulation) and float32 inputs as TF32 when
torch.backends.cuda.matmul.allow_tf32 is set, else in full float32 ("ieee"), like torch's matmul.
Needs a CUDA device, or TRITON_INTERPRET=1 set before this module is imported (tests only).
Block sizes are untuned defaults. Measured on an H200 (`specrl bench kernels`, bfloat16, TF32 on;
2026-12-04): these kernels ran at 0.21-0.91x the speed of the chunked torch twin at the same peak
memory (1024 x 1024 x 49152: 9.3 vs 8.5 ms; 16384 x 4096 x 131072: 1444 vs 370 ms; the float32
atomics of dense_grads), and with bfloat16 inputs dense_grads' d hidden is wrong: its error
against a float64 reference is as large as its values (N 2048, H 1024, V 49152), while row_stats
and d weight agree (splitting g into two bfloat16 parts fixed d weight's rounding, not d hidden;
cause not found). So the dispatch (`fused_drafter_loss`) runs the twin on every device; these
kernels stay, tested against the twin (the bfloat16 case an expected failure on a GPU), as the
starting point for a tuned and corrected kernel.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .drafter_loss import RowStats, compute_dtype, drafter_loss

BLOCK_N = 64
BLOCK_V = 128
MAX_BLOCK_H = 64
TARGET_PROGRAMS_PER_SM = 4


@triton.jit
def _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """z [BLOCK_N, BLOCK_V] float32 = x[rows] @ W[cols]^T (zero rows/cols where masked)."""
    z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        x = tl.load(x_ptr + rows[:, None] * H + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * H + hs[None, :], mask=col_ok[:, None] & h_ok[None, :], other=0.0)
        z = tl.dot(x, tl.trans(w), z, input_precision=PRECISION)
    return z


@triton.jit
def _row_stats_kernel(x_ptr, w_ptr, t_ptr, part_ptr, N, V, H, V_PER_SPLIT, BLOCK_N: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    lowest = -3.4028234663852886e38  # stands in for a running max of -inf: exp(-inf - lowest) = 0, not NaN
    m_z = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    m_t = tl.full((BLOCK_N,), lowest, dtype=tl.float32)
    s_z = tl.zeros((BLOCK_N,), dtype=tl.float32)
    s_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    top = tl.zeros((BLOCK_N,), dtype=tl.int64)
    v_start = split * V_PER_SPLIT
    v_end = tl.minimum(v_start + V_PER_SPLIT, V)
    for c0 in range(v_start, v_end, BLOCK_V):
        cols = (c0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < v_end
        z = _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, BLOCK_N, BLOCK_V, BLOCK_H, PRECISION)
        z_in = tl.where(col_ok[None, :], z, float("-inf"))  # masked columns: 0 in z, -inf in z_in
        t = tl.load(t_ptr + rows[:, None] * V + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(z_in, axis=1)
        top = tl.where(chunk_max > m_z, c0 + tl.argmax(z_in, axis=1, tie_break_left=True), top)
        new = tl.maximum(m_z, chunk_max)
        s_z = s_z * tl.exp(m_z - new) + tl.sum(tl.exp(z_in - new[:, None]), axis=1)
        m_z = new
        new = tl.maximum(m_t, tl.max(t, axis=1))
        scale = tl.exp(m_t - new)
        e = tl.exp(t - new[:, None])
        s_t = s_t * scale + tl.sum(e, axis=1)
        acc = acc * scale + tl.sum(e * (tl.where(e > 0, t, 0.0) - z), axis=1)  # finite: no 0 * inf
        m_t = new
    m_t = tl.where(s_t > 0, m_t, float("-inf"))  # this slice saw only -inf targets
    base = part_ptr + split * N + rows
    stride = tl.num_programs(1) * N
    tl.store(base, m_z, mask=row_ok)
    tl.store(base + stride, s_z, mask=row_ok)
    tl.store(base + 2 * stride, m_t, mask=row_ok)
    tl.store(base + 3 * stride, s_t, mask=row_ok)
    tl.store(base + 4 * stride, acc, mask=row_ok)
    tl.store(base + 5 * stride, top.to(tl.float32), mask=row_ok)  # exact below 2^24


@triton.jit
def _dense_grads_kernel(x_ptr, w_ptr, t_ptr, lse_q_ptr, lse_t_ptr, alpha_ptr, beta_ptr, gx_ptr, gw_ptr, N, V, H,
                        NEED_X: tl.constexpr, NEED_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    row_ok = rows < N
    col_ok = cols < V
    z = _logits_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, BLOCK_N, BLOCK_V, BLOCK_H, PRECISION)
    lse_q = tl.load(lse_q_ptr + rows, mask=row_ok, other=0.0)
    lse_t = tl.load(lse_t_ptr + rows, mask=row_ok, other=0.0)
    alpha = tl.load(alpha_ptr + rows, mask=row_ok, other=0.0)
    beta = tl.load(beta_ptr + rows, mask=row_ok, other=0.0)
    ok = row_ok[:, None] & col_ok[None, :]
    t = tl.load(t_ptr + rows[:, None] * V + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
    g = tl.exp(z - lse_q[:, None]) * alpha[:, None] - tl.exp(t - lse_t[:, None]) * beta[:, None]
    g = tl.where(ok, g, 0.0)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        if NEED_X:
            w = tl.load(w_ptr + cols[:, None] * H + hs[None, :], mask=col_ok[:, None] & h_ok[None, :], other=0.0)
            tl.atomic_add(gx_ptr + rows[:, None] * H + hs[None, :],
                          tl.dot(g.to(w.dtype), w, input_precision=PRECISION), mask=row_ok[:, None] & h_ok[None, :])
        if NEED_W:
            x = tl.load(x_ptr + rows[:, None] * H + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            tl.atomic_add(gw_ptr + cols[:, None] * H + hs[None, :],
                          tl.dot(tl.trans(g).to(x.dtype), x, input_precision=PRECISION),
                          mask=col_ok[:, None] & h_ok[None, :])


def _precision(x: torch.Tensor) -> str:
    if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _blocks(hidden: torch.Tensor, block_n: int | None, block_v: int | None) -> tuple[int, int, int]:
    h = hidden.shape[1]
    return block_n or BLOCK_N, block_v or BLOCK_V, min(MAX_BLOCK_H, max(16, triton.next_power_of_2(h)))


def _splits(n_blocks: int, v_blocks: int, device: torch.device) -> int:
    """Vocabulary slices per row block: enough programs to fill the GPU (2 under the interpreter,
    so the tests cover the merge)."""
    if device.type != "cuda":
        return min(2, v_blocks)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(v_blocks, triton.cdiv(TARGET_PROGRAMS_PER_SM * sms, n_blocks)))


def row_stats(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
              block_n: int | None = None, block_v: int | None = None) -> RowStats:
    """The Triton kernel; same signature and results as `drafter_loss.row_stats`.

    hidden [N, H] float32/bfloat16/float16, weight [V, H] same dtype, target_logits [N, V] float.
    Returns RowStats of [N] float32 tensors (top: int64), see drafter_loss.RowStats.
    block_n, block_v: tile sizes (powers of two >= 16; defaults BLOCK_N, BLOCK_V).
    """
    n, v = hidden.shape[0], weight.shape[0]
    bn, bv, bh = _blocks(hidden, block_n, block_v)
    v_blocks = triton.cdiv(v, bv)
    splits = _splits(triton.cdiv(n, bn), v_blocks, hidden.device)
    v_per_split = triton.cdiv(v_blocks, splits) * bv
    splits = triton.cdiv(v, v_per_split)  # no empty slice
    part = torch.empty(6, splits, n, dtype=torch.float32, device=hidden.device)
    _row_stats_kernel[(triton.cdiv(n, bn), splits)](
        hidden.contiguous(), weight.contiguous(), target_logits.contiguous(), part, n, v, hidden.shape[1],
        v_per_split, BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh, PRECISION=_precision(hidden))
    m_z, s_z, m_t, s_t, acc, top = part
    best = m_z.argmax(0, keepdim=True)  # the slice holding the row's max (the first on ties)
    high = m_z.gather(0, best)[0]
    s_z = (s_z * torch.exp(m_z - high)).sum(0)
    lse_q = high + s_z.log()
    high_t = m_t.amax(0)
    scale = torch.exp(m_t - high_t)
    s_t, acc = (s_t * scale).sum(0), (acc * scale).sum(0)
    lse_t = high_t + s_t.log()
    return RowStats(lse_q, lse_t, acc / s_t - lse_t + lse_q, top.gather(0, best)[0].long(), (s_z - 1) / s_z)


def dense_grads(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor, lse_q: torch.Tensor,
                lse_t: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, need_hidden: bool, need_weight: bool,
                block_n: int | None = None, block_v: int | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The Triton kernel; same signature and results as `drafter_loss.dense_grads` (float32 out)."""
    n, h = hidden.shape
    v = weight.shape[0]
    bn, bv, bh = _blocks(hidden, block_n, block_v)
    cdt = compute_dtype(hidden)
    grad_x = torch.zeros(n, h, dtype=cdt, device=hidden.device) if need_hidden else None
    grad_w = torch.zeros(v, h, dtype=cdt, device=weight.device) if need_weight else None
    _dense_grads_kernel[(triton.cdiv(n, bn), triton.cdiv(v, bv))](
        hidden.contiguous(), weight.contiguous(), target_logits.contiguous(), lse_q.float().contiguous(),
        lse_t.float().contiguous(), alpha.float().contiguous(), beta.float().contiguous(),
        grad_x if need_hidden else lse_q, grad_w if need_weight else lse_q, n, v, h,
        NEED_X=need_hidden, NEED_W=need_weight, BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh, PRECISION=_precision(hidden))
    return grad_x, grad_w


def drafter_loss_triton(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                        rejected_rows: torch.Tensor, rejected_tokens: torch.Tensor, neg_weight: float = 0.0,
                        block_n: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """The fused loss with autograd on these kernels, no input checks (the dispatch's job)."""
    return drafter_loss(hidden, weight, target_logits, rejected_rows, rejected_tokens, neg_weight,
                        impl=sys.modules[__name__], block_n=block_n, block_v=block_v)
