"""The drafter pass beside the plain target step, per weight format and batch size.

Speculation pays when tokens per step / (1 + k c + v) > 1 (Leviathan et al.), with c the cost of a drafter pass
over that of a target step: at c = 0.6 no head pays, at c = 0.1 a head whose first draft is accepted half the
time pays ~1.3x alone. A pass is what `propose` spends per drafted token (its forward over one position, the
head over the draft vocabulary, the argmax); the step is one target forward over one position a row and its
logits. Both are timed by `CostModel.measure`, the engine's start-up prior, so the bench prints what the
planner plans with: the fastest of `rounds` rounds, each call warmed up once, on scratch KV caches at position 0.
By bytes a pass reads the drafter's layer and fc in the target's format and its draft-vocabulary head (int8 for
a q4 target, as the target's own head): `weight_bytes` says how much, beside the target's.
"""

from __future__ import annotations

import torch

from specrl.speculation.controller import CostModel


def draft_pass_rows(target, drafter, batch_sizes: list[int], dtype_label: str, rounds: int = 5) -> list[dict]:
    """target: a prepared Llama; drafter: its prepared EagleDrafter -> one row per batch size B: the drafter
    pass and the plain target step in ms, their ratio (c), and the weight bytes each reads."""
    with torch.inference_mode():
        costs = CostModel.measure(target, drafter, batch_sizes, [1], rounds)
    drafter_bytes = drafter_weight_bytes(drafter)
    target_bytes = target.streamed_weight_bytes()
    return [{"dtype": dtype_label, "batch": b, "draft_pass_ms": costs.draft[b] * 1e3,
             "target_step_ms": costs.target[(b, 1)] * 1e3, "pass_over_step": costs.draft[b] / costs.target[(b, 1)],
             "drafter_weight_bytes": drafter_bytes, "target_weight_bytes": target_bytes,
             "draft_vocab_size": drafter.cfg.draft_vocab_size, "rounds": rounds, "threads": torch.get_num_threads()}
            for b in batch_sizes]


def drafter_weight_bytes(drafter) -> int:
    """Bytes of weights one drafter pass reads: fc, the layer's four linears and the output head (the target's
    own when the drafter has no reduced one)."""
    weights = [drafter.fc, drafter.head_weight(), *(getattr(drafter.layer, name) for name in drafter.layer.LINEARS)]
    return sum(w.nbytes for w in weights)


def print_draft_pass(rows: list[dict]) -> None:
    for r in rows:
        print(f"drafter pass ({r['dtype']}, B={r['batch']}, {r['draft_vocab_size']}-id head): {r['draft_pass_ms']:.3f} ms"
              f" against a plain target step of {r['target_step_ms']:.3f} ms: c = {r['pass_over_step']:.3f}"
              f" ({r['drafter_weight_bytes'] / 1e6:.1f} MB against {r['target_weight_bytes'] / 1e6:.1f} MB of weights)")
