"""Speculative verification by rejection sampling: the Triton kernel (twin: verify.rejection_sample_torch).

The rule, the padding convention for per-row draft lengths and the inverse-CDF draw are those of
kernels/verify.py. One program per row b:

1. acceptance, i = 0..L_b-1 while every earlier draft was kept: a sampled row loads three
   scalars (p_i(d_i), q_i(d_i), u_i) and keeps d_i iff u_i * q_i(d_i) < p_i(d_i); a greedy row
   keeps it iff d_i == argmax p_i (one pass over V in BLOCK_V chunks, first index on ties).
2. the last token at position a = accepted: greedy rows emit argmax p_a (already known when the
   loop stopped on a mismatch); sampled rows draw from w = max(0, p_a - q_a) if a < L_b and w has
   mass, else w = p_a, with u = uniforms[b, L_b]: pass 1 sums w chunk by chunk, pass 2 counts
   #{x : c_x <= u * total}. Both passes build the running cdf c the same way (carry + in-chunk
   cumsum), so `total` is exactly the last c_x and a zero-weight token is never drawn.

Reads per row: L_b + 1 scalars for sampled rows plus 2 (or 4 with q) passes over V at the last
position; greedy rows one pass over V per position reached. The [B, K+1] outputs are written
in place (emitted pre-filled with -1). Needs a CUDA device, or TRITON_INTERPRET=1 set before this
module is imported (then it runs on CPU tensors, slowly: tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_V = 4096


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """argmax over row_ptr[0:V] (values >= 0), first index on ties -> int32 scalar."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full((), -1.0, dtype=tl.float32)
    best_idx = tl.zeros((), dtype=tl.int32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offs, mask=start + offs < V, other=-1.0)
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32)
        better = m > best  # strictly: an equal value in a later chunk does not win
        best_idx = tl.where(better, start + i, best_idx)
        best = tl.where(better, m, best)
    return best_idx


@triton.jit
def _weights(p_ptr, q_ptr, start, offs, V, USE_RES: tl.constexpr):
    """Chunk [start, start+BLOCK_V) of w = max(0, p - q) if USE_RES else p (0 past V)."""
    mask = start + offs < V
    w = tl.load(p_ptr + start + offs, mask=mask, other=0.0)
    if USE_RES:
        w = tl.maximum(w - tl.load(q_ptr + start + offs, mask=mask, other=0.0), 0.0)
    return w


@triton.jit
def _total(p_ptr, q_ptr, V, USE_RES: tl.constexpr, BLOCK_V: tl.constexpr):
    """sum_x w_x, accumulated as the cdf's last value (carry + max of in-chunk cumsum)."""
    offs = tl.arange(0, BLOCK_V)
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        total += tl.max(tl.cumsum(_weights(p_ptr, q_ptr, start, offs, V, USE_RES), axis=0), axis=0)
    return total


@triton.jit
def _inverse_cdf(p_ptr, q_ptr, V, USE_RES: tl.constexpr, u, total, BLOCK_V: tl.constexpr):
    """#{x : c_x <= u * total} clamped to V - 1 -> int32 scalar."""
    offs = tl.arange(0, BLOCK_V)
    target = u * total
    carry = tl.zeros((), dtype=tl.float32)
    count = tl.zeros((), dtype=tl.int32)
    for start in range(0, V, BLOCK_V):
        cdf = carry + tl.cumsum(_weights(p_ptr, q_ptr, start, offs, V, USE_RES), axis=0)
        count += tl.sum(((cdf <= target) & (start + offs < V)).to(tl.int32), axis=0)
        carry = tl.max(cdf, axis=0)
    return tl.minimum(count, V - 1)


@triton.jit
def _verify_kernel(tokens_ptr, q_ptr, p_ptr, u_ptr, greedy_ptr, lens_ptr, accepted_ptr, emitted_ptr,
                   K, V, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    length = tl.load(lens_ptr + b).to(tl.int32)
    is_greedy = tl.load(greedy_ptr + b) != 0
    p_row = p_ptr + b * (K + 1) * V
    q_row = q_ptr + b * K * V
    u_row = u_ptr + b * (K + 1)

    # 1. acceptance
    acc = tl.zeros((), dtype=tl.int32)
    top = tl.zeros((), dtype=tl.int32)  # greedy rows: argmax p at the position the loop stopped on
    active = length > 0
    for i in range(0, K):
        if active:
            d = tl.load(tokens_ptr + b * K + i).to(tl.int32)
            if is_greedy:
                top = _row_argmax(p_row + i * V, V, BLOCK_V)
                ok = d == top
            else:
                p_d = tl.load(p_row + i * V + d)
                if HAS_Q:
                    ok = tl.load(u_row + i) * tl.load(q_row + i * V + d) < p_d
                else:  # cannot happen after the dispatch's checks (sampled rows with drafts need q)
                    ok = p_d < 0.0
            acc += ok.to(tl.int32)
            active = ok & (i + 1 < length)

    # 2. the recovered / bonus token
    p_last = p_row + acc * V
    if is_greedy:
        if acc == length:
            top = _row_argmax(p_last, V, BLOCK_V)
        last = top
    else:
        u = tl.load(u_row + length)
        res_total = tl.zeros((), dtype=tl.float32)
        if HAS_Q:
            if acc < length:
                res_total = _total(p_last, q_row + acc * V, V, True, BLOCK_V)
        if res_total > 0.0:
            last = _inverse_cdf(p_last, q_row + acc * V, V, True, u, res_total, BLOCK_V)
        else:
            total = _total(p_last, p_last, V, False, BLOCK_V)
            last = _inverse_cdf(p_last, p_last, V, False, u, total, BLOCK_V)

    offs_k = tl.arange(0, BLOCK_K)
    drafts = tl.load(tokens_ptr + b * K + offs_k, mask=offs_k < acc, other=-1)
    tl.store(emitted_ptr + b * (K + 1) + offs_k, drafts, mask=offs_k < acc)
    tl.store(emitted_ptr + b * (K + 1) + acc, last.to(tl.int64))
    tl.store(accepted_ptr + b, acc.to(tl.int64))


def rejection_sample_triton(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                            uniforms: torch.Tensor, greedy: torch.Tensor, draft_lens: torch.Tensor | None = None,
                            *, block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; same signature and tokens as `verify.rejection_sample_torch`.

    draft_tokens [B, K] int64; draft_probs [B, K, V] float or None; target_probs [B, K+1, V] float;
    uniforms [B, K+1] float in [0, 1); greedy [B] bool; draft_lens [B] int64 in 0..K or None.
    Probabilities and uniforms are read as float32 (converted here if given in another dtype).
    Returns accepted [B] int64 and emitted [B, K+1] int64 (-1 past accepted[b]).
    block_v: the vocabulary chunk (a power of two, >= 16; default min(4096, next_pow2(V))).
    """
    bsz, k = draft_tokens.shape
    v = target_probs.shape[-1]
    device = draft_tokens.device
    lens = torch.full((bsz,), k, dtype=torch.long, device=device) if draft_lens is None else draft_lens.long()
    p = target_probs.to(torch.float32).contiguous()
    has_q = draft_probs is not None and k > 0
    q = draft_probs.to(torch.float32).contiguous() if has_q else p  # p: a valid pointer never read
    accepted = torch.empty(bsz, dtype=torch.long, device=device)
    emitted = torch.full((bsz, k + 1), -1, dtype=torch.long, device=device)
    block_v = block_v or min(MAX_BLOCK_V, max(16, triton.next_power_of_2(v)))
    _verify_kernel[(bsz,)](draft_tokens.long().contiguous(), q, p, uniforms.to(torch.float32).contiguous(),
                           greedy.to(torch.uint8).contiguous(), lens.contiguous(), accepted, emitted, k, v,
                           HAS_Q=has_q, BLOCK_V=block_v,
                           BLOCK_K=max(16, triton.next_power_of_2(k + 1)), num_warps=4 if block_v <= 1024 else 8)
    return accepted, emitted
