"""Commit: a verify step's tokens join the request: stop checks, version runs, log-probs.

The emitted tokens of a step (accepted drafts, then the target's own token) are appended up to
the first stop: EOS or a stop token id ends the request and is not shown; max_tokens cuts the
rest; a stop string (checked on the decoded text) ends it at the token that completes it (a step
can emit many tokens: the ones after that token are dropped).
Every change of (target version, drafter version) over a request's output starts a version run
`[first output index, target version, drafter version]`, so a response says which weights
produced each token.
"""

from __future__ import annotations

import torch

from specrl.engine.sequence import Sequence


def commit_tokens(seq: Sequence, emitted: list[int], eos_ids: frozenset[int], tokenizer,
                  drafter_version: str) -> tuple[list[int], str | None]:
    """Append what the client sees of `emitted` to `seq.output_ids`. -> (those tokens, the finish
    reason if this step ends the request)."""
    visible, reason = stop_check(seq, emitted, eos_ids)
    versions = [seq.target_version, drafter_version]
    if visible and (not seq.version_runs or seq.version_runs[-1][1:] != versions):
        seq.version_runs.append([len(seq.output_ids), *versions])
    before = len(seq.output_ids)
    seq.output_ids.extend(visible)
    # A stop string also wins over a stop token or max_tokens reached later in the same step.
    skip = seq.params.skip_special_tokens
    if visible and seq.params.stop and stop_string_hit(seq.output_ids, seq.params.stop, tokenizer, skip):
        # The first token that completes a stop string: text only grows as tokens are added, so
        # a bisection over the step's tokens finds it in log2(len) decodes.
        lo, hi = 1, len(visible)
        while lo < hi:
            mid = (lo + hi) // 2
            if stop_string_hit(seq.output_ids[: before + mid], seq.params.stop, tokenizer, skip):
                hi = mid
            else:
                lo = mid + 1
        del seq.output_ids[before + lo:]
        visible, reason = visible[:lo], "stop"
    return visible, reason


def stop_check(seq: Sequence, emitted: list[int], eos_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """-> the tokens the client sees, and a finish reason if this step ends the request.
    EOS and stop token ids end it and are not shown; max_tokens cuts the rest."""
    stops = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else eos_ids)
    visible = []
    for token in emitted:
        if token in stops:
            return visible, "stop"
        visible.append(token)
        if len(seq.output_ids) + len(visible) >= seq.params.max_tokens:
            return visible, "length"
    return visible, None


def stop_string_hit(token_ids: list[int], stops: tuple[str, ...], tokenizer,
                    skip_special_tokens: bool = True) -> bool:
    """Whether the text of `token_ids` (decoded as the client sees it) holds a stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return any(s in text for s in stops)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int,
                   log_normaliser: torch.Tensor | None = None) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [T, V] that chose `tokens` -> per token (its log-prob, the top `top` (id, log-prob)): a logit minus its
    position's log normaliser, log sum exp over V, taken from `log_normaliser` [T] where every entry is finite (a
    plain step's C draw computed it: `Verification.log_normaliser`), else computed here."""
    x = logits.float()
    if log_normaliser is None or not bool(torch.isfinite(log_normaliser).all()):
        log_normaliser = torch.logsumexp(x, dim=-1)
    chosen = (x[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] - log_normaliser).tolist()
    if top > 0:
        values, ids = x.topk(top, dim=-1)
        values = values - log_normaliser[:, None]
    else:
        values, ids = x[:, :0], x[:, :0].long()
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]
