"""Input checks of the dispatch layer: a ValueError naming the argument, before any kernel launch.

Shapes, dtypes and devices are always checked (no device work). Values are checked with a few
vectorised reductions and one host sync:
- verification: per used position, sum_x p(x) and sum_x q(x) within PROB_ATOL of 1 (a NaN or
  inf anywhere in the row makes the sum fail too); uniforms in [0, 1); draft ids in [0, V);
  draft_lens in [0, K]. Negative entries whose row still sums to 1 are not looked for (it would
  cost another pass over [B, K+1, V]). The sums read all of p and q, more than sampling reads:
  `specrl bench kernels` reports the cost; a caller that built the probabilities itself may pass
  check_values=False (shapes, dtypes and devices are still checked).
- drafter loss: every row of target_logits has a finite max (catches NaN, +inf and rows that are
  all -inf; -inf entries are allowed, they mean p = 0); rejected rows/ids in range.
K = 0 is valid for verification (plain decoding: one token from p_1). An empty batch (B = 0, or
N = 0 positions for the loss, whose mean would be undefined) is an error: skip the call instead.
"""

from __future__ import annotations

import math

import torch

PROB_ATOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEFAULT_PROB_ATOL = 1e-3  # float32 / float64: a softmax over 128k entries sums to 1 within ~1e-6


def _expect(name: str, x, ndim: int, kind: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    ok = {"int": not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool,
          "float": x.dtype.is_floating_point, "bool": x.dtype == torch.bool}[kind]
    if not ok:
        what = {"int": "an integer", "float": "a floating-point", "bool": "a bool"}[kind]
        raise ValueError(f"{name} must be {what} tensor, got {x.dtype}")


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], described: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {described} = {expected}, got {tuple(x.shape)}")


def _same_device(named: dict[str, torch.Tensor | None]) -> None:
    devices = {name: x.device for name, x in named.items() if x is not None}
    first = next(iter(devices.values()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device}, the other inputs on {first}")


def _row_sums_bad(probs: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """probs [B, T, V], used [B, T] bool -> [B, T] bool: used rows whose sum is not within the tolerance of 1."""
    sums = probs.sum(-1, dtype=torch.float64 if probs.dtype == torch.float64 else torch.float32)
    atol = PROB_ATOL.get(probs.dtype, DEFAULT_PROB_ATOL)
    return used & ~((sums - 1).abs() <= atol)  # NaN sums fail the comparison


def check_verify_inputs(draft_tokens, draft_probs, target_probs, uniforms, greedy, draft_lens=None, *,
                        check_values: bool = True) -> None:
    """Raise ValueError naming the first bad argument of `rejection_sample` (see its docstring).
    check_values=False: shapes, dtypes and devices only (no pass over the probabilities)."""
    _expect("draft_tokens", draft_tokens, 2, "int")
    bsz, k = draft_tokens.shape
    if bsz == 0:
        raise ValueError("draft_tokens: empty batch (B = 0); verify only when at least one row is running")
    _expect("target_probs", target_probs, 3, "float")
    v = target_probs.shape[-1]
    if v == 0:
        raise ValueError("target_probs: empty vocabulary (V = 0)")
    _shape("target_probs", target_probs, (bsz, k + 1, v), "[B, K+1, V]")
    if draft_probs is not None:
        _expect("draft_probs", draft_probs, 3, "float")
        _shape("draft_probs", draft_probs, (bsz, k, v), "[B, K, V]")
    _expect("uniforms", uniforms, 2, "float")
    _shape("uniforms", uniforms, (bsz, k + 1), "[B, K+1]")
    _expect("greedy", greedy, 1, "bool")
    _shape("greedy", greedy, (bsz,), "[B]")
    if draft_lens is not None:
        _expect("draft_lens", draft_lens, 1, "int")
        _shape("draft_lens", draft_lens, (bsz,), "[B]")
    _same_device({"draft_tokens": draft_tokens, "draft_probs": draft_probs, "target_probs": target_probs,
                  "uniforms": uniforms, "greedy": greedy, "draft_lens": draft_lens})
    if not check_values:
        return
    device = draft_tokens.device
    lens = torch.full((bsz,), k, dtype=torch.long, device=device) if draft_lens is None else draft_lens.long()
    positions = torch.arange(k + 1, device=device)[None, :]
    used = positions <= lens[:, None]  # [B, K+1]: target positions and uniforms row b reads
    drafted = used[:, :k] & (positions[:, :k] < lens[:, None])  # [B, K]
    flags = {
        "draft_lens": (lens < 0) | (lens > k),
        "draft_tokens": drafted & ((draft_tokens < 0) | (draft_tokens >= v)),
        "target_probs": _row_sums_bad(target_probs, used),
        "uniforms": used & ~((uniforms >= 0) & (uniforms < 1)),
    }
    if draft_probs is not None:
        flags["draft_probs"] = _row_sums_bad(draft_probs, drafted)
    else:
        flags["draft_probs"] = ~greedy & (lens > 0)
    bad = torch.stack([f.any() for f in flags.values()]).tolist()  # the one host sync
    if not any(bad):
        return
    name = next(n for n, b in zip(flags, bad) if b)
    where = flags[name].nonzero()[0].tolist()
    raise ValueError(_verify_message(name, where, k, v, draft_tokens, target_probs, draft_probs, uniforms, lens))


def _verify_message(name, where, k, v, draft_tokens, target_probs, draft_probs, uniforms, lens) -> str:
    at = f"row {where[0]}" + (f", position {where[1]}" if len(where) > 1 else "")
    if name == "draft_lens":
        return f"draft_lens must be in 0..K={k}, got {int(lens[where[0]])} at {at}"
    if name == "draft_tokens":
        return (f"draft_tokens must be ids in 0..V-1={v - 1} (up to draft_lens), "
                f"got {int(draft_tokens[tuple(where)])} at {at}")
    if name == "uniforms":
        return f"uniforms must be in [0, 1), got {float(uniforms[tuple(where)])} at {at}"
    if name == "draft_probs" and draft_probs is None:
        return f"draft_probs is None but {at} is sampled (not greedy) with {int(lens[where[0]])} drafts"
    probs = target_probs if name == "target_probs" else draft_probs
    total = float(probs[tuple(where)].double().sum())
    return (f"{name} must be probabilities over V (no NaN, summing to 1 within "
            f"{PROB_ATOL.get(probs.dtype, DEFAULT_PROB_ATOL)}), but {at} sums to {total}")


def check_loss_inputs(hidden, weight, target_logits, rejected_rows, rejected_tokens, neg_weight) -> None:
    """Raise ValueError naming the first bad argument of `fused_drafter_loss` (see its docstring)."""
    _expect("hidden", hidden, 2, "float")
    n, h = hidden.shape
    if n == 0:
        raise ValueError("hidden: no positions (N = 0); the loss is a mean over positions, skip the call instead")
    if h == 0:
        raise ValueError("hidden: empty hidden size (H = 0)")
    _expect("weight", weight, 2, "float")
    if weight.shape[0] == 0 or weight.shape[1] != h:
        raise ValueError(f"weight must have shape [V_d, H] with V_d >= 1 and H = {h}, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; use one dtype for both")
    v = weight.shape[0]
    _expect("target_logits", target_logits, 2, "float")
    _shape("target_logits", target_logits, (n, v), "[N, V_d]")
    if target_logits.requires_grad:
        raise ValueError("target_logits requires grad, but no gradient flows to the target; "
                         "pass target_logits.detach()")
    _expect("rejected_rows", rejected_rows, 1, "int")
    _expect("rejected_tokens", rejected_tokens, 1, "int")
    if rejected_tokens.shape != rejected_rows.shape:
        raise ValueError(f"rejected_tokens must have the shape of rejected_rows {tuple(rejected_rows.shape)}, "
                         f"got {tuple(rejected_tokens.shape)}")
    if not isinstance(neg_weight, (int, float)) or not math.isfinite(neg_weight) or neg_weight < 0:
        raise ValueError(f"neg_weight must be a finite number >= 0, got {neg_weight!r}")
    _same_device({"hidden": hidden, "weight": weight, "target_logits": target_logits, "rejected_rows": rejected_rows,
                  "rejected_tokens": rejected_tokens})
    flags = {
        "target_logits": ~torch.isfinite(target_logits.amax(-1)),  # NaN propagates through amax
        "rejected_rows": (rejected_rows < 0) | (rejected_rows >= n),
        "rejected_tokens": (rejected_tokens < 0) | (rejected_tokens >= v),
    }
    bad = torch.stack([f.any() for f in flags.values()]).tolist()
    if not any(bad):
        return
    name = next(n_ for n_, b in zip(flags, bad) if b)
    i = int(flags[name].nonzero()[0, 0])
    if name == "target_logits":
        raise ValueError(f"target_logits row {i} has no finite maximum (NaN, +inf, or every entry -inf)")
    limit = n if name == "rejected_rows" else v
    value = int((rejected_rows if name == "rejected_rows" else rejected_tokens)[i])
    raise ValueError(f"{name} must be in 0..{limit - 1}, got {value} at index {i}")
