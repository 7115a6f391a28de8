"""Bad input at the dispatch layer (kernels/checks.py): a ValueError naming the argument, raised
before any kernel runs (the kernels are replaced by a function that fails the test if called)."""

from __future__ import annotations

import pytest
import torch

import specrl.kernels.dispatch as dispatch
from specrl.kernels import fused_drafter_loss, rejection_sample
from tests.kernels.conftest import make_inputs, mixed_batch


@pytest.fixture(autouse=True)
def _no_kernel_runs(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a kernel ran on bad input")

    monkeypatch.setattr(dispatch, "rejection_sample_torch", must_not_run)
    monkeypatch.setattr(dispatch.loss_twin, "drafter_loss", must_not_run)


def verify_args(ragged=True):
    drafts, q, p, u, greedy, lens = mixed_batch(6, 3, 8, seed=70, ragged=ragged)
    lens = torch.tensor([0, 3, 1, 2, 3, 3]) if ragged else None
    if ragged:
        drafts = torch.where(torch.arange(3)[None, :] < lens[:, None], drafts.clamp(min=0), -1)
    return dict(draft_tokens=drafts, draft_probs=q, target_probs=p, uniforms=u, greedy=greedy, draft_lens=lens)


def _set(args, name, fn):
    args = dict(args)
    args[name] = fn(args[name])
    return args


def _at(x, index, value):
    x = x.clone()
    x[index] = value
    return x


VERIFY_CASES = {
    # name: (argument expected in the message, mutation of the valid arguments)
    "empty batch": ("draft_tokens", lambda a: {k: (v[:0] if v is not None else v) for k, v in a.items()}),
    "tokens 1-D": ("draft_tokens", lambda a: _set(a, "draft_tokens", lambda x: x[:, 0])),
    "tokens float": ("draft_tokens", lambda a: _set(a, "draft_tokens", lambda x: x.float())),
    "target K mismatch": ("target_probs", lambda a: _set(a, "target_probs", lambda x: x[:, :-1])),
    "target B mismatch": ("target_probs", lambda a: _set(a, "target_probs", lambda x: x[:-1])),
    "draft V mismatch": ("draft_probs", lambda a: _set(a, "draft_probs", lambda x: x[..., :-1])),
    "uniforms shape": ("uniforms", lambda a: _set(a, "uniforms", lambda x: x[:, :-1])),
    "greedy dtype": ("greedy", lambda a: _set(a, "greedy", lambda x: x.long())),
    "lens shape": ("draft_lens", lambda a: _set(a, "draft_lens", lambda x: x[:-1])),
    "lens > K": ("draft_lens", lambda a: _set(a, "draft_lens", lambda x: _at(x, 2, 4))),
    "lens < 0": ("draft_lens", lambda a: _set(a, "draft_lens", lambda x: _at(x, 2, -1))),
    "token >= V": ("draft_tokens", lambda a: _set(a, "draft_tokens", lambda x: _at(x, (1, 2), 8))),
    "token < 0": ("draft_tokens", lambda a: _set(a, "draft_tokens", lambda x: _at(x, (1, 0), -1))),
    "target NaN": ("target_probs", lambda a: _set(a, "target_probs", lambda x: _at(x, (3, 1, 4), float("nan")))),
    "target inf": ("target_probs", lambda a: _set(a, "target_probs", lambda x: _at(x, (3, 1, 4), float("inf")))),
    "target unnormalised": ("target_probs", lambda a: _set(a, "target_probs", lambda x: x * 1.01)),
    "target logits given": ("target_probs", lambda a: _set(a, "target_probs", lambda x: x.log())),
    "draft NaN": ("draft_probs", lambda a: _set(a, "draft_probs", lambda x: _at(x, (1, 2, 0), float("nan")))),
    "draft unnormalised": ("draft_probs", lambda a: _set(a, "draft_probs", lambda x: x * 0.9)),
    "uniform = 1": ("uniforms", lambda a: _set(a, "uniforms", lambda x: _at(x, (1, 3), 1.0))),
    "uniform NaN": ("uniforms", lambda a: _set(a, "uniforms", lambda x: _at(x, (1, 0), float("nan")))),
    "no draft probs for sampled rows": ("draft_probs", lambda a: {**a, "draft_probs": None,
                                                                  "greedy": torch.zeros(6, dtype=torch.bool)}),
    "device mismatch": ("uniforms", lambda a: _set(a, "uniforms", lambda x: x.to("meta"))),
    "not a tensor": ("target_probs", lambda a: _set(a, "target_probs", lambda x: x.tolist())),
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_verify_bad_input(case):
    name, mutate = VERIFY_CASES[case]
    with pytest.raises(ValueError, match=name):
        rejection_sample(**mutate(verify_args()))


def test_verify_valid_input_reaches_the_kernel(monkeypatch):
    """The valid versions of the cases above pass the checks, including K = 0 (plain decoding),
    NaN and junk ids in padding, and draft_probs None when every row with drafts is greedy."""
    calls = []
    monkeypatch.setattr(dispatch, "rejection_sample_torch", lambda *args: calls.append(args))
    args = verify_args()
    rejection_sample(**args)
    rejection_sample(**verify_args(ragged=False))
    p = args["target_probs"]
    rejection_sample(torch.zeros(6, 0, dtype=torch.long), None, p[:, :1], args["uniforms"][:, :1],
                     torch.zeros(6, dtype=torch.bool))
    padded = dict(args, target_probs=_at(p, (0, 2), float("nan")), uniforms=_at(args["uniforms"], (0, 3), 2.0))
    rejection_sample(**padded)  # row 0 has no drafts: only its position 0 is used
    greedy_where_drafted = (args["draft_lens"] > 0)
    rejection_sample(**dict(args, draft_probs=None, greedy=greedy_where_drafted))
    assert len(calls) == 5


LOSS_CASES = {
    "no positions": ("hidden", lambda a: {**a, "hidden": a["hidden"][:0], "target_logits": a["target_logits"][:0],
                                          "rejected_rows": a["rejected_rows"][:0],
                                          "rejected_tokens": a["rejected_tokens"][:0]}),
    "hidden 3-D": ("hidden", lambda a: _set(a, "hidden", lambda x: x[None])),
    "H mismatch": ("weight", lambda a: _set(a, "weight", lambda x: x[:, :-1])),
    "dtype mismatch": ("weight", lambda a: _set(a, "weight", lambda x: x.double())),
    "target V mismatch": ("target_logits", lambda a: _set(a, "target_logits", lambda x: x[:, :-1])),
    "target N mismatch": ("target_logits", lambda a: _set(a, "target_logits", lambda x: x[:-1])),
    "target NaN": ("target_logits", lambda a: _set(a, "target_logits", lambda x: _at(x, (4, 2), float("nan")))),
    "target +inf": ("target_logits", lambda a: _set(a, "target_logits", lambda x: _at(x, (4, 2), float("inf")))),
    "target row all -inf": ("target_logits", lambda a: _set(a, "target_logits", lambda x: _at(x, 4, float("-inf")))),
    "target requires grad": ("target_logits", lambda a: _set(a, "target_logits", lambda x: x.requires_grad_())),
    "rows out of range": ("rejected_rows", lambda a: _set(a, "rejected_rows", lambda x: _at(x, 0, 37))),
    "tokens out of range": ("rejected_tokens", lambda a: _set(a, "rejected_tokens", lambda x: _at(x, 0, -1))),
    "pairs length mismatch": ("rejected_tokens", lambda a: _set(a, "rejected_tokens", lambda x: x[:-1])),
    "rows float": ("rejected_rows", lambda a: _set(a, "rejected_rows", lambda x: x.float())),
    "negative weight": ("neg_weight", lambda a: {**a, "neg_weight": -0.5}),
    "NaN weight": ("neg_weight", lambda a: {**a, "neg_weight": float("nan")}),
}


def loss_args():
    hidden, weight, target, rows, tokens = make_inputs(dtype=torch.float32)
    return dict(hidden=hidden, weight=weight, target_logits=target, rejected_rows=rows, rejected_tokens=tokens,
                neg_weight=0.5)


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_bad_input(case):
    name, mutate = LOSS_CASES[case]
    with pytest.raises(ValueError, match=name):
        fused_drafter_loss(**mutate(loss_args()))


def test_check_values_false_keeps_the_shape_checks(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "rejection_sample_torch", lambda *args: calls.append(args))
    args = verify_args()
    rejection_sample(**dict(args, target_probs=args["target_probs"] * 1.5), check_values=False)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(**dict(args, target_probs=args["target_probs"][:, :-1]), check_values=False)
