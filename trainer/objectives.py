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

`example_loss` is the loss of one training example (its context's features, its trained
positions, its rejected drafts and steps): the drafter trainer's, and `bench learn`'s.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from specrl.kernels import fused_drafter_loss
from specrl.models.drafter import EagleDrafter
from specrl.trainer.contexts import Example

OBJECTIVES = ("kl", "kl_neg", "pg")
NEG_WEIGHT = 0.5
PG_KL_WEIGHT = 0.1
EMPTY = torch.zeros(0, dtype=torch.long)


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


def example_loss(drafter: EagleDrafter, objective: str, unroll_steps: int, example: Example, positions: list[int],
                 hidden: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The objective's loss at `positions` of one example. hidden [T-1, H] float32: the target's
    features at positions 0..T-2 of example.tokens [T]; target_logits: hidden [N, H] -> the target's
    logits over the draft vocabulary [N, V_d] float32."""
    tokens = torch.tensor(example.tokens)
    out = drafter(hidden[None], tokens[None, 1:])[0]  # [T-1, H]: index j predicts x_{j+2}
    index = torch.tensor(positions)
    # Both distributions over the draft vocabulary: with a reduced one, the target's is
    # renormalised over it (the drafter cannot propose anything else). The target at j+1
    # predicts x_{j+2}.
    target = target_logits(hidden[index + 1])
    head = drafter.head_weight()
    row_of = {p: i for i, p in enumerate(positions)}
    rejected_rows, rejected_tokens = in_draft_vocab(drafter, [(row_of[p], t) for p, t in example.rejected if p in row_of],
                                                    width=2)
    step_rows, step_tokens, step_returns = in_draft_vocab(
        drafter, [(row_of[pos - 2], d[0], a) for pos, d, a in example.steps if d and pos - 2 in row_of], width=3)
    loss = drafter_loss(objective, drafter.head_input(out[index]), head, target,
                        rejected_rows=rejected_rows, rejected_tokens=rejected_tokens,
                        step_rows=step_rows, step_tokens=step_tokens, step_returns=step_returns)
    for _ in range(unroll_steps):
        # Training-time test: index j reads out[j-1], the drafter's own prediction of h_j, as a
        # later draft does when serving (approximation: earlier positions are unrolled too,
        # where serving attends to a prefix built from real features). Measured on SmolLM2:
        # second-draft acceptance 0.044 vs 0.010 of steps after the same 50 optimizer steps.
        out = drafter(torch.cat([hidden[:1], out.detach()[:-1]])[None], tokens[None, 1:])[0]
        loss = loss + drafter_loss("kl", drafter.head_input(out[index]), head, target,
                                   rejected_rows=EMPTY, rejected_tokens=EMPTY, step_rows=EMPTY,
                                   step_tokens=EMPTY, step_returns=EMPTY)
    return loss / (1 + unroll_steps)


def in_draft_vocab(drafter: EagleDrafter, rows: list[tuple[int, ...]], width: int) -> tuple[torch.Tensor, ...]:
    """(row, target token id, ...) tuples -> one int64 tensor per column, keeping the tuples
    whose token is in the draft vocabulary, the token as its draft id."""
    columns = torch.tensor(rows, dtype=torch.long).reshape(-1, width).T
    ids = drafter.to_draft_ids(columns[1])
    kept = ids >= 0
    return (columns[0][kept], ids[kept], *(c[kept] for c in columns[2:]))
