"""The entry points the engine and the trainer call: check the inputs, then run the fastest
implementation measured for the device: verification runs the Triton kernel when the tensors are
on a CUDA device and triton imports (4.6-11x the twin's speed on an H200), else the torch twin; the drafter
loss runs its chunked torch twin everywhere (on an H200 it beat the Triton loss kernels at every
shape measured: drafter_loss_triton.py)."""

from __future__ import annotations

import functools
import importlib.util

import torch

from . import drafter_loss as loss_twin
from .checks import check_loss_inputs, check_verify_inputs
from .verify import rejection_sample_torch

@functools.cache
def triton_available() -> bool:
    """Whether the triton package is installed (checked once; nothing is imported here)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and triton_available()


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     uniforms: torch.Tensor, greedy: torch.Tensor, draft_lens: torch.Tensor | None = None, *,
                     check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification of a batch (the rule and the padding convention: kernels/verify.py).

    draft_tokens [B, K] int64 (B >= 1, K >= 0; K = 0 is plain decoding: one token from p_1).
    draft_probs  [B, K, V] float or None (allowed only when every row with drafts is greedy).
    target_probs [B, K+1, V] float, each used row summing to 1.
    uniforms     [B, K+1] float in [0, 1).
    greedy       [B] bool.
    draft_lens   [B] int64 in 0..K, or None (every row has K drafts).
    Returns accepted [B] int64 and emitted [B, K+1] int64 (-1 past each row's accepted + 1 tokens).
    Raises ValueError naming the argument for bad shapes, dtypes, devices or values (checks.py);
    check_values=False skips the value checks (one pass over p and q, about the cost of the
    sampling itself on CPU: see `specrl bench kernels`).
    """
    check_verify_inputs(draft_tokens, draft_probs, target_probs, uniforms, greedy, draft_lens,
                        check_values=check_values)
    if use_triton(target_probs):
        from .verify_triton import rejection_sample_triton

        return rejection_sample_triton(draft_tokens, draft_probs, target_probs, uniforms, greedy, draft_lens)
    return rejection_sample_torch(draft_tokens, draft_probs, target_probs, uniforms, greedy, draft_lens)


def fused_drafter_loss(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                       rejected_rows: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None,
                       neg_weight: float = 0.0) -> torch.Tensor:
    """Forward KL(p || q) averaged over N positions + neg_weight * mean over rejected drafts of
    -log(1 - q(d)), without materialising the [N, V] draft logits (math: kernels/drafter_loss.py).

    hidden          [N, H] float32/bfloat16/float16 (float64: twin only): the head's input, i.e.
                    the drafter's hidden states after its final norm; N >= 1.
    weight          [V, H] same dtype: the draft head (V = draft vocabulary; may be frozen).
    target_logits   [N, V] float: the target's logits over the same vocabulary (-inf allowed,
                    meaning p = 0; no gradient flows to them).
    rejected_rows   [R] int64 in 0..N-1 and rejected_tokens [R] int64 in 0..V-1: the rejected
                    drafts (row, draft-vocabulary id); None or empty for none.
    neg_weight      float >= 0.
    Returns the loss [] float32 (float64 for float64 inputs), differentiable w.r.t. hidden and weight.
    """
    device = hidden.device if isinstance(hidden, torch.Tensor) else None
    empty = torch.zeros(0, dtype=torch.long, device=device)
    rejected_rows = empty if rejected_rows is None else rejected_rows
    rejected_tokens = empty if rejected_tokens is None else rejected_tokens
    check_loss_inputs(hidden, weight, target_logits, rejected_rows, rejected_tokens, neg_weight)
    return loss_twin.drafter_loss(hidden, weight, target_logits, rejected_rows.long(), rejected_tokens.long(),
                                  float(neg_weight))
