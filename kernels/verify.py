"""Speculative verification by rejection sampling (plain-torch twin).

Definitions (Leviathan et al. 2023; Chen et al. 2023), per row b with K draft tokens d_1..d_K
drawn from the draft distributions q_1..q_K, and target distributions p_1..p_{K+1} at the same
positions (p_i is the target's distribution for the token d_i would fill):

- accepted: d_i is kept if every earlier one was kept and u_i < p_i(d_i) / q_i(d_i).
  Acceptance at one position happens with probability sum_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i).
- recovered: at the first rejected position i, a token is drawn from the residual
  norm(max(0, p_i - q_i)); then the emitted token at that position follows p_i exactly.
- bonus: when all K are accepted, one more token is drawn from p_{K+1}, for free.

So every step emits accepted + 1 tokens, distributed exactly as the target would sample them.
Greedy rows accept d_i iff d_i == argmax p_i and emit argmax at the first mismatch (or the
bonus), which reproduces plain greedy decoding token for token.
"""

from __future__ import annotations

import torch


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     uniforms: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    draft_tokens [B, K] int64: the drafted ids (K may be 0).
    draft_probs  [B, K, V] float32: the draft distributions the tokens were drawn from, in the
                 target vocabulary; may be None when every row is greedy.
    target_probs [B, K+1, V] float32: target distributions (temperature / top-p applied).
    uniforms     [B, K+1] float32 in [0, 1): column i < K decides acceptance of d_{i+1},
                 column K draws the recovered or bonus token.
    greedy       [B] bool.
    Returns accepted [B] int64 (0..K) and emitted [B, K+1] int64: row b's first accepted[b]+1
    entries are the accepted drafts followed by the recovered/bonus token; the rest are -1.
    """
    bsz, k = draft_tokens.shape
    target_argmax = target_probs.argmax(-1)  # [B, K+1]
    if k > 0:
        p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        ok_greedy = target_argmax[:, :k] == draft_tokens
        if draft_probs is None:
            ok = ok_greedy
        else:
            q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
            ok = torch.where(greedy[:, None], ok_greedy, uniforms[:, :k] * q_draft < p_draft)
        accepted = ok.long().cumprod(-1).sum(-1)
    else:
        accepted = torch.zeros(bsz, dtype=torch.long)

    rows = torch.arange(bsz)
    final_p = target_probs[rows, accepted]  # [B, V]
    if draft_probs is not None and k > 0:
        rejected = accepted < k
        q_at = draft_probs[rows, accepted.clamp(max=k - 1)]
        residual = (final_p - q_at).clamp_(min=0)
        # An all-zero residual only happens when p == q (then rejection had probability 0).
        use_residual = rejected & (residual.sum(-1) > 0)
        final_p = torch.where(use_residual[:, None], residual, final_p)
    last = torch.where(greedy, target_argmax[rows, accepted], inverse_cdf_sample(final_p, uniforms[:, k]))

    emitted = torch.full((bsz, k + 1), -1, dtype=torch.long)
    if k > 0:
        keep = torch.arange(k)[None, :] < accepted[:, None]
        emitted[:, :k] = torch.where(keep, draft_tokens, emitted[:, :k])
    emitted[rows, accepted] = last
    return accepted, emitted


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [..., V] float32 (need not sum to 1), uniforms [...] in [0, 1) -> ids [...] int64.
    Only tokens with positive probability can be drawn."""
    cdf = probs.cumsum(-1)
    target = (uniforms * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
