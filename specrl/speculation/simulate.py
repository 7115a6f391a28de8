"""Exact greedy acceptance of a drafter on a known context, without running the target again.

Given the target's features over a context whose continuation the target produced greedily,
greedy speculative decoding with draft length k accepts, at a step whose pending token sits at
position n, the longest prefix of the drafter's chain d_1..d_k that equals x_{n+1}..x_{n+k}.
The chain starts from the drafter position n-1 read with real features (the catch-up) and
continues on the drafter's own outputs. This computes the chain for every n at once (one KV
slot per n, sharing the teacher-forced prefix), then walks the steps a real decode would take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.models.drafter import EagleDrafter
from specrl.speculation.quantities import SpecCounts


@dataclass
class Acceptance:
    accepted: torch.Tensor  # [N] int64: accepted drafts at every pending position n in [start, T)
    walk: list[int]  # accepted drafts at the steps greedy decoding actually takes from `start`

    @property
    def tau(self) -> float:
        """Tokens per verify step along the walk (bonus included)."""
        return sum(a + 1 for a in self.walk) / max(len(self.walk), 1)


@torch.inference_mode()
def simulate_greedy(drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, start: int, k: int) -> Acceptance:
    """features [T, H] float32: target hidden at every position of `tokens` [T] int64; the
    tokens from position `start` on are the target's greedy continuation. -> Acceptance."""
    t = len(tokens)
    pending = torch.arange(max(start, 1), t)  # pending-token positions n with a known x_{n+1}.. suffix
    n = len(pending)
    if n == 0:
        return Acceptance(torch.zeros(0, dtype=torch.long), [])
    cache = drafter.new_cache(n, t + k)
    prefix = drafter(features[None, : t - 1], tokens[None, 1:t], torch.tensor([0]), torch.tensor([0]), cache)
    cache.k[0, 1:] = cache.k[0, :1]  # every slot shares the teacher-forced prefix
    cache.v[0, 1:] = cache.v[0, :1]
    slots = torch.arange(n)
    hidden = prefix[0, pending - 1]  # chain start: read (h_{n-1}, x_n)
    matched = torch.ones(n, dtype=torch.bool)
    accepted = torch.zeros(n, dtype=torch.long)
    for i in range(1, k + 1):
        draft = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))
        target_pos = pending + i
        real = torch.where(target_pos < t, tokens[target_pos.clamp(max=t - 1)], torch.full_like(draft, -1))
        matched &= draft == real
        accepted += matched.long()
        if i < k:
            hidden = drafter(hidden[:, None], draft[:, None], slots, pending + i - 1, cache)[:, 0]
    walk, position = [], start
    while position < t - 1:
        a = int(accepted[position - pending[0]])
        walk.append(a)
        position += a + 1
    return Acceptance(accepted, walk)


def heldout_acceptance(drafter: EagleDrafter, heldout, k: int) -> tuple[float | None, SpecCounts]:
    """heldout: (example, features [T-1, H] float32) pairs, each example's tokens the target's greedy
    continuation from example.start on -> (acceptance length: tokens per verify step along each walk,
    averaged over the examples, None without any; the drafts counted as a step of k at every pending
    position whose k next tokens are known, for the per-position acceptance rates)."""
    taus, counts = [], SpecCounts()
    for example, features in heldout:
        acceptance = simulate_greedy(drafter, features, torch.tensor(example.tokens), example.start, k)
        taus.append(acceptance.tau)
        whole = len(example.tokens) - k - max(example.start, 1)  # pending positions n with n + k < T
        for accepted in acceptance.accepted[:max(whole, 0)].tolist():
            counts.count(k, accepted)
    return (sum(taus) / len(taus) if taus else None), counts
