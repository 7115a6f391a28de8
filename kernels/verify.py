"""Speculative verification by rejection sampling: the plain-torch twin and the naive per-row loop.

Definitions (Leviathan et al. 2023; Chen et al. 2023), per row b with L_b draft tokens d_1..d_L
drawn from the draft distributions q_1..q_L, and target distributions p_1..p_{L+1} at the same
positions (p_i is the target's distribution for the token d_i would fill):

- accepted: d_i is kept if every earlier one was kept and u_i < p_i(d_i) / q_i(d_i)
  (computed as u_i * q_i(d_i) < p_i(d_i), so p_i(d_i) = 0 is never accepted).
  Acceptance at one position happens with probability sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i).
- recovered: at the first rejected position i, a token is drawn from the residual
  norm(max(0, p_i - q_i)); then the emitted token at that position follows p_i exactly.
- bonus: when all L_b are accepted, one more token is drawn from p_{L_b+1}, for free.

So every step emits accepted + 1 tokens, distributed exactly as the target would sample them.
Greedy rows accept d_i iff d_i == argmax p_i (first index on ties) and emit argmax at the first
mismatch (or the bonus), which reproduces plain greedy decoding token for token.

Per-row draft lengths (padding convention): a batch is padded to K = max_b L_b. Row b uses
draft_tokens[b, :L_b], draft_probs[b, :L_b], target_probs[b, :L_b + 1] and uniforms[b, :L_b + 1];
the entries past those are padding, never read for a decision (any values, e.g. token -1). The
recovered/bonus token of row b is drawn with uniforms[b, L_b], so a row gives the same answer
padded in a batch as in a batch of its own with K = L_b. draft_lens = None means L_b = K for all.

Drawing a token from an unnormalised distribution w [V] with a uniform u (inverse CDF): with
c = cumsum(w), the token is #{x : c_x <= u * c_{V-1}} (clamped to V - 1), i.e. the first x with
c_x > u * c_{V-1}; a zero-weight token never has the first such c_x.

Every function here assumes valid inputs: `specrl.kernels.rejection_sample` checks them first.
"""

from __future__ import annotations

import torch

CPU_CHUNK_ELEMENTS = 1 << 18  # rows of V probabilities per sampled chunk on CPU (1 MiB of float32)


def rejection_sample_torch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                           uniforms: torch.Tensor, greedy: torch.Tensor,
                           draft_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `verify_triton.rejection_sample_triton` (same signature, same tokens).

    draft_tokens [B, K] int64: the drafted ids (K may be 0); entries past draft_lens[b] are padding.
    draft_probs  [B, K, V] float: the draft distributions the tokens were drawn from, in the
                 target vocabulary; may be None when every row with drafts is greedy.
    target_probs [B, K+1, V] float: target distributions (temperature / top-p applied).
    uniforms     [B, K+1] float in [0, 1): column i < L_b decides acceptance of d_{i+1},
                 column L_b draws the recovered or bonus token.
    greedy       [B] bool.
    draft_lens   [B] int64 in 0..K, or None (every row has K drafts).
    Returns accepted [B] int64 (0..L_b) and emitted [B, K+1] int64: row b's first accepted[b]+1
    entries are the accepted drafts followed by the recovered/bonus token; the rest are -1.
    """
    bsz, k = draft_tokens.shape
    v = target_probs.shape[-1]
    device = draft_tokens.device
    rows = torch.arange(bsz, device=device)
    lens = torch.full((bsz,), k, dtype=torch.long, device=device) if draft_lens is None else draft_lens.long()
    flat_p = target_probs.reshape(bsz * (k + 1), v)  # views: row b's position i is row b (K+1) + i
    flat_q = draft_probs.reshape(bsz * k, v) if draft_probs is not None and k > 0 else None
    greedy_rows, sampled_rows = greedy.nonzero().squeeze(1), (~greedy).nonzero().squeeze(1)
    accepted = _accepted(draft_tokens, draft_probs, target_probs, uniforms, greedy, lens, greedy_rows)

    last = torch.empty(bsz, dtype=torch.long, device=device)
    at = rows * (k + 1) + accepted
    last[greedy_rows] = flat_p.index_select(0, at[greedy_rows]).argmax(-1)
    # Sampled rows draw from [rows, V] copies: on CPU a few rows at a time into reused buffers, so
    # that they stay in cache and no fresh pages are faulted in per chunk.
    step = max(1, CPU_CHUNK_ELEMENTS // v) if device.type == "cpu" else max(1, bsz)
    buf = target_probs.new_empty(3, min(step, sampled_rows.numel()), v)
    for c in range(0, sampled_rows.numel(), step):
        s = sampled_rows[c:c + step]
        final_p, scratch, cdf = buf[:, :s.numel()]
        torch.index_select(flat_p, 0, at[s], out=final_p)
        if flat_q is not None:
            residual = torch.index_select(flat_q, 0, s * k + accepted[s].clamp(max=k - 1), out=scratch)
            torch.sub(final_p, residual, out=residual).clamp_(min=0)
            # An all-zero residual only happens when p == q (then rejection had probability 0).
            use_residual = (accepted[s] < lens[s]) & (residual.sum(-1) > 0)
            final_p = torch.where(use_residual[:, None], residual, final_p, out=final_p)
        last[s] = inverse_cdf_sample(final_p, uniforms[s, lens[s]], cdf=cdf)

    emitted = torch.full((bsz, k + 1), -1, dtype=torch.long, device=device)
    if k > 0:
        keep = torch.arange(k, device=device)[None, :] < accepted[:, None]
        emitted[:, :k] = torch.where(keep, draft_tokens, emitted[:, :k])
    emitted[rows, accepted] = last
    return accepted, emitted


def _accepted(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
              uniforms: torch.Tensor, greedy: torch.Tensor, lens: torch.Tensor,
              greedy_rows: torch.Tensor) -> torch.Tensor:
    """-> accepted [B] int64: the length of each row's accepted prefix (shapes as rejection_sample_torch)."""
    bsz, k = draft_tokens.shape
    device = draft_tokens.device
    if k == 0:
        return torch.zeros(bsz, dtype=torch.long, device=device)
    valid = torch.arange(k, device=device)[None, :] < lens[:, None]
    tokens = torch.where(valid, draft_tokens, 0)  # padding ids may be anything
    ok = torch.zeros(bsz, k, dtype=torch.bool, device=device)
    # Greedy rows: position by position, argmax only for the rows still accepting (the argmax is
    # the costliest pass over V; most rows stop early).
    flat_p = target_probs.reshape(bsz * (k + 1), -1)
    active = greedy_rows[lens[greedy_rows] > 0]
    for i in range(k):
        if active.numel() == 0:
            break
        hit = flat_p.index_select(0, active * (k + 1) + i).argmax(-1) == tokens[active, i]
        ok[active[hit], i] = True
        active = active[hit & (lens[active] > i + 1)]
    if draft_probs is not None:
        p_draft = target_probs[:, :k].gather(-1, tokens[..., None]).squeeze(-1)
        q_draft = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
        ok = torch.where(greedy[:, None], ok, uniforms[:, :k] * q_draft < p_draft)
    return (ok & valid).long().cumprod(-1).sum(-1)


def rejection_sample_rowwise(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                             uniforms: torch.Tensor, greedy: torch.Tensor,
                             draft_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive reference: a Python loop over rows and positions, a transcription of the rule in
    the module docstring. Same signature and results as `rejection_sample_torch` (the tests check
    both against it; the benchmark times it as the per-row baseline)."""
    bsz, k = draft_tokens.shape
    device = draft_tokens.device
    lens = [k] * bsz if draft_lens is None else draft_lens.tolist()
    acc_out = []
    emit_out = torch.full((bsz, k + 1), -1, dtype=torch.long, device=device)
    for b in range(bsz):
        length, acc, is_greedy = lens[b], 0, bool(greedy[b])
        for i in range(length):
            d = int(draft_tokens[b, i])
            p = target_probs[b, i]
            ok = (d == int(p.argmax())) if is_greedy else bool(uniforms[b, i] * draft_probs[b, i, d] < p[d])
            if not ok:
                break
            acc += 1
        emit_out[b, :acc] = draft_tokens[b, :acc]
        if is_greedy:
            last = int(target_probs[b, acc].argmax())
        else:
            dist = target_probs[b, acc]
            if acc < length:
                residual = (target_probs[b, acc] - draft_probs[b, acc]).clamp(min=0)
                if residual.sum() > 0:
                    dist = residual
            last = int(inverse_cdf_sample(dist[None], uniforms[b, length][None])[0])
        emit_out[b, acc] = last
        acc_out.append(acc)
    return torch.tensor(acc_out, dtype=torch.long, device=device), emit_out


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor, cdf: torch.Tensor | None = None) -> torch.Tensor:
    """probs [..., V] float (need not sum to 1), uniforms [...] in [0, 1) -> ids [...] int64.
    Only tokens with positive probability can be drawn (for u < 1, u * c < c in floating point).
    cdf: an optional buffer shaped like probs for the cumulative sums."""
    cdf = torch.cumsum(probs, -1, out=cdf) if cdf is not None else probs.cumsum(-1)
    target = (uniforms * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
