"""Drafter objectives. Reward of a verify step = accepted drafts; under rejection sampling the
acceptance at one position is 1 - TV(p, q), so the drafter learns by bringing q close to p.

- "kl": forward KL(p || q) at every trained position, p the target's distribution (distillation).
- "kl_neg": "kl" plus the implicit negative feedback: -log(1 - q(d)) for each draft token d the
  target rejected, at the position where it was rejected.
- "pg": policy gradient with the accepted length as return: for each recorded step, the log-prob
  under the current drafter of its first draft token (the one drafted from real features),
  weighted by (accepted - baseline); the baseline is the batch mean. Plus a small KL term that
  keeps it anchored (pure REINFORCE from day 0 rarely sees a reward).

Shapes: draft_logits [N, V_d] float32 and target_logits [N, V_d] float32, both over the draft
vocabulary (a reduced one: the caller takes the target's logits of those ids only, so p is
renormalised over what the drafter can propose) for the same N positions; token ids are draft ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

OBJECTIVES = ("kl", "kl_neg", "pg")
NEG_WEIGHT = 0.5
PG_KL_WEIGHT = 0.1


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q) = sum_x p(x) (log p(x) - log q(x))."""
    log_p = F.log_softmax(target_logits, -1)
    log_q = F.log_softmax(draft_logits, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def rejected_penalty(draft_logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean of -log(1 - q(d)) over (row, rejected token d) pairs; 0 when there are none."""
    if len(rows) == 0:
        return draft_logits.new_zeros(())
    q = F.softmax(draft_logits[rows], -1).gather(-1, tokens[:, None]).squeeze(-1)
    return -torch.log1p(-q.clamp(max=1 - 1e-6)).mean()


def policy_gradient(draft_logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                    returns: torch.Tensor) -> torch.Tensor:
    """-(R - mean R) * log q(d) averaged over steps; rows/tokens/returns [S]."""
    if len(rows) < 2:
        return draft_logits.new_zeros(())
    log_q = F.log_softmax(draft_logits[rows], -1).gather(-1, tokens[:, None]).squeeze(-1)
    advantage = returns.float() - returns.float().mean()
    return -(advantage * log_q).mean()


def drafter_loss(objective: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, *,
                 rejected_rows: torch.Tensor, rejected_tokens: torch.Tensor,
                 step_rows: torch.Tensor, step_tokens: torch.Tensor, step_returns: torch.Tensor) -> torch.Tensor:
    if objective == "kl":
        return forward_kl(draft_logits, target_logits)
    if objective == "kl_neg":
        return forward_kl(draft_logits, target_logits) + NEG_WEIGHT * rejected_penalty(draft_logits, rejected_rows,
                                                                                        rejected_tokens)
    if objective == "pg":
        return (policy_gradient(draft_logits, step_rows, step_tokens, step_returns)
                + PG_KL_WEIGHT * forward_kl(draft_logits, target_logits))
    raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
