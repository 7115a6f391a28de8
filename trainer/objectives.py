"""Drafter objectives. Reward of a verify step = accepted drafts; under rejection sampling the
acceptance at one position is 1 - TV(p, q), so the drafter learns by bringing q close to p.

- "kl": forward KL(p || q) at every trained position, p the target's distribution (distillation).
- "kl_neg": "kl" plus the implicit negative feedback: -log(1 - q(d)) for each draft token d the
  target rejected, at the position where it was rejected.
- "pg": policy gradient with the accepted length as return: for each recorded step, the log-prob
  under the current drafter of its first draft token (the one drafted from real features),
  weighted by (accepted - baseline); the baseline is the batch mean. Plus a small KL term that
  keeps it anchored (pure REINFORCE from day 0 rarely sees a reward).

The KL and negative terms are `specrl.kernels.fused_drafter_loss` (its docstring has the math):
computed from the head's input and weight in vocabulary chunks, so the [N, V_d] draft logits of
every trained position never exist whole. Only the policy-gradient term reads logits, at its few
step rows.

Shapes: head_input [N, H] float32, the drafter's hidden states after its final norm at N trained
positions; head_weight [V_d, H], the draft head; target_logits [N, V_d] float32, the target's
logits over the same draft vocabulary (a reduced one: the caller takes the target's logits of those
ids only, so p is renormalised over what the drafter can propose). Token ids are draft ids; rows
index the N positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrl.kernels import fused_drafter_loss

OBJECTIVES = ("kl", "kl_neg", "pg")
NEG_WEIGHT = 0.5
PG_KL_WEIGHT = 0.1


def policy_gradient(draft_logits: torch.Tensor, tokens: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """-(R - mean R) * log q(d) averaged over S steps: draft_logits [S, V_d] at each step's row,
    tokens [S] its first draft token, returns [S] its accepted length. 0 for fewer than 2 steps."""
    if len(tokens) < 2:
        return draft_logits.new_zeros(())
    log_q = F.log_softmax(draft_logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    advantage = returns.float() - returns.float().mean()
    return -(advantage * log_q).mean()


def drafter_loss(objective: str, head_input: torch.Tensor, head_weight: torch.Tensor, target_logits: torch.Tensor, *,
                 rejected_rows: torch.Tensor, rejected_tokens: torch.Tensor,
                 step_rows: torch.Tensor, step_tokens: torch.Tensor, step_returns: torch.Tensor) -> torch.Tensor:
    if objective == "kl":
        return fused_drafter_loss(head_input, head_weight, target_logits)
    if objective == "kl_neg":
        return fused_drafter_loss(head_input, head_weight, target_logits, rejected_rows, rejected_tokens, NEG_WEIGHT)
    if objective == "pg":
        step_logits = head_input[step_rows] @ head_weight.T  # [S, V_d]: S is a few rows per example
        return (policy_gradient(step_logits, step_tokens, step_returns)
                + PG_KL_WEIGHT * fused_drafter_loss(head_input, head_weight, target_logits))
    raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
