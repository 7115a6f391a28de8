"""Propose: the drafter catches up on verified positions, then drafts k tokens per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.kernels import inverse_cdf_sample
from specrl.models.drafter import EagleDrafter
from specrl.models.kv_cache import KVCache
from specrl.spec.sampling import RowSampler


@dataclass
class Draft:
    """tokens [B, K] int64 (target ids); probs [B, K, V] float32 in the target vocabulary, the
    distributions the tokens were drawn from (None when every row is greedy); logprobs [B, K]
    float32, log q of each drafted token (temperature 1 for greedy rows)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    logprobs: torch.Tensor

    @classmethod
    def empty(cls, batch: int) -> "Draft":
        return cls(torch.zeros(batch, 0, dtype=torch.long), None, torch.zeros(batch, 0))


def catch_up(drafter: EagleDrafter, cache: KVCache, slots: torch.Tensor, start: torch.Tensor,
             features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Feed the drafter the target's real features for positions it has not seen.

    features [B, P, H] float32 (target hidden at drafter positions start[b]..), tokens [B, P]
    int64 (the token after each of those positions); rows shorter than P are right-padded
    (their padded entries land beyond the real ones and are overwritten before anyone reads
    them). -> drafter hidden [B, P, H]."""
    return drafter(features, tokens, slots, start, cache)


def propose(drafter: EagleDrafter, cache: KVCache, slots: torch.Tensor, start: torch.Tensor,
            features: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, k: int,
            sampler: RowSampler) -> Draft:
    """Draft k tokens for each of B sequences.

    slots [B] int64; start [B] int64, drafter position of each row's first pending entry;
    features [B, P, H], tokens [B, P]: pending entries (see `catch_up`), lengths [B] how many
    are real. The catch-up pass yields the first draft; each further draft is one pass over
    the drafter's own predicted hidden state and the token it just drafted."""
    rows = torch.arange(len(slots))
    hidden = catch_up(drafter, cache, slots, start, features, tokens)[rows, lengths - 1]  # [B, H]
    position = start + lengths
    out_tokens, out_probs, out_logprobs = [], [], []
    for i in range(k):
        logits = drafter.logits(hidden)  # [B, V_d]
        probs = sampler.probs(logits[:, None])[:, 0]
        draft_ids = torch.where(sampler.greedy, logits.argmax(-1), inverse_cdf_sample(probs, sampler.uniforms(1)[:, 0]))
        out_logprobs.append(torch.log_softmax(logits, -1)[rows, draft_ids] if sampler.all_greedy
                            else probs[rows, draft_ids].log())
        token = drafter.to_target_ids(draft_ids)
        out_tokens.append(token)
        if not sampler.all_greedy:
            out_probs.append(_to_target_vocab(drafter, probs))
        if i + 1 < k:
            hidden = drafter(hidden[:, None], token[:, None], slots, position, cache)[:, 0]
            position = position + 1
    if k == 0:
        return Draft.empty(len(slots))
    return Draft(torch.stack(out_tokens, 1), torch.stack(out_probs, 1) if out_probs else None,
                 torch.stack(out_logprobs, 1))


def _to_target_vocab(drafter: EagleDrafter, probs: torch.Tensor) -> torch.Tensor:
    """probs [B, V_d] -> [B, V] (zero outside the draft vocabulary)."""
    if drafter.draft_to_target is None:
        return probs
    full = probs.new_zeros(probs.shape[0], drafter.cfg.vocab_size)
    return full.index_copy_(1, drafter.draft_to_target, probs)
