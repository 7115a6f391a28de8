"""Verify: one target forward over [pending token, d_1..d_k] per sequence, then the acceptance rule.

The forward over k+1 positions gives the target's distribution p_1..p_{k+1} at each of them in
one pass, processed as the request asks (`RowSampler.probs`: penalties, logit bias, min_tokens,
temperature, min_p, top_k, top_p), p_i counting d_1..d_{i-1} as generated. Two rules, both exact
(every emitted token follows p):

- rejection sampling (`specrl.kernels.rejection_sample`, whose docstring defines accepted,
  recovered and bonus tokens): greedy rows accept exactly the drafts equal to the argmax; sampled
  rows accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), the best a draft distribution q
  can do (1 - TV(p, q)), and draw the recovered token from the residual.
- the coupled rule, for seeded sampled rows (`RowSampler.coupled`): the token at position n is
  t_n = inverse-CDF draw of p_n with u_n, the seed's uniform for that position, whatever was
  drafted; drafts are accepted while d_i == t_i, and the step emits t up to the first mismatch.
  So a seed reproduces the same text with or without speculation, whatever the proposer and k.
  A deterministic draft d is accepted with probability p(d), as under rejection sampling with a
  one-hot q; the head drafts with the same u_n (quantile coupling), which accepts less than
  rejection sampling does with its sampled drafts (measured on SmolLM2 logits with noise, T=1:
  0.55 vs 0.83 per token): the price of reproducibility, paid only by seeded requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.kernels import inverse_cdf_sample, rejection_sample
from specrl.models.kv_cache import KVCache
from specrl.models.llama import Llama, argmax
from specrl.speculation.propose import Draft
from specrl.speculation.sampling import RowSampler


@dataclass
class Verification:
    """accepted [B] int64; emitted [B, K+1] int64 (accepted drafts then the target's token, -1
    after); hidden [B, K+1, H] float32, the target's last hidden state at each verified position
    (the drafter's next features); logits [B, K+1, V] float32 that chose each emitted token;
    log_normaliser [B, K+1] float32, log sum exp of those logits where the step had it for free (a plain
    step's C draw at temperature 1 without top_k: `RowSampler.draw`), NaN elsewhere, or None (the step has none)."""

    accepted: torch.Tensor
    emitted: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    log_normaliser: torch.Tensor | None = None

    def rows(self) -> tuple[list[int], list[list[int]]]:
        """-> (accepted per row, each row's emitted tokens: its accepted drafts and the target's
        token), converted once for the step."""
        accepted = self.accepted.tolist()
        return accepted, [tokens[: n + 1] for tokens, n in zip(self.emitted.tolist(), accepted)]


def verify(target: Llama, cache: KVCache, pending: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
           draft: Draft, sampler: RowSampler) -> Verification:
    """pending [B] int64: each row's last committed token (its next input); slots [B] int64;
    start [B] int64: the position of the pending token (positions before it have KV)."""
    tokens = torch.cat([pending[:, None], draft.tokens], dim=1)
    lengths = None if draft.lengths is None else draft.lengths + 1
    hidden = target(tokens, slots, start, cache, lengths)
    logits = _logits(target, hidden, lengths)
    if not draft.tokens.shape[1] and sampler.draws_from_logits:  # a plain step: each row's token in one C pass
        emitted, log_normaliser = sampler.draw(logits[:, 0], sampler.uniforms(1, start + 1)[:, 0])
        # the draw's normaliser is of logits / T over the ids top_k keeps: the logits' own where T = 1 without top_k
        # (the log-probs' denominator)
        whole = sampler.temperature == 1.0 if sampler.top_k is None else (sampler.temperature == 1.0) & (sampler.top_k == 0)
        raw = torch.where(whole, log_normaliser, torch.full_like(log_normaliser, float("nan")))
        return Verification(torch.zeros(len(emitted), dtype=torch.long), emitted[:, None], hidden, logits, raw[:, None])
    # the target's distributions after the processing, position i counting d_1..d_i as generated
    probs = _target_scores(sampler, logits, draft.tokens, target.cfg.eos_token_ids)
    accepted, emitted = accept(draft, probs, sampler.uniforms(tokens.shape[1], start + 1), sampler)
    return Verification(accepted, emitted, hidden, logits)


def _target_scores(sampler: RowSampler, logits: torch.Tensor, tokens: torch.Tensor | None,
                   eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits [B, T, V] -> what `accept` reads of the target [B, T, V]: its processed distributions
    (`RowSampler.probs`). When every row is greedy, only their argmax is read, and the processed
    logits have the same one: the softmax over the vocabulary is skipped (~0.3 ms a step at B = 1,
    most of 2 ms at B = 8, T = 5, on SmolLM2's 49k)."""
    if sampler.all_greedy:
        return sampler.adjusted(logits, tokens, eos_ids)
    return sampler.probs(logits, tokens, eos_ids)


def _logits(target: Llama, hidden: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """hidden [B, T, H] -> logits [B, T, V], the head computed for each row's real positions only
    (padding gets 0: read by nobody)."""
    bsz, t, _ = hidden.shape
    if lengths is None or bool((lengths == t).all()):
        return target.logits(hidden)
    real = (torch.arange(t)[None, :] < lengths[:, None]).reshape(-1).nonzero().squeeze(1)
    rows = target.logits(hidden.reshape(bsz * t, -1).index_select(0, real))
    return rows.new_zeros(bsz * t, rows.shape[-1]).index_copy_(0, real, rows).view(bsz, t, -1)


def sample_first(target: Llama, hidden: torch.Tensor, position: int, sampler: RowSampler) -> Verification:
    """The token after a prompt: a verify step with no drafts over the prompt's last hidden state.
    hidden [1, H] float32; position: the new token's. -> Verification with K = 0 (hidden [1, 0, H])."""
    last = hidden[:, None]
    logits = target.logits(last)
    probs = _target_scores(sampler, logits, None, target.cfg.eos_token_ids)
    accepted, emitted = accept(Draft.empty(1), probs, sampler.uniforms(1, torch.tensor([position])), sampler)
    return Verification(accepted, emitted, last[:, :0], logits)


def accept(draft: Draft, probs: torch.Tensor, uniforms: torch.Tensor, sampler: RowSampler
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, K+1, V] float32 (the target's, processed: `RowSampler.probs`; when every row is
    greedy, the adjusted logits of `_target_scores`), uniforms [B, K+1] -> accepted [B] int64,
    emitted [B, K+1] int64 (as `rejection_sample`), each row by its rule."""
    if sampler.all_greedy:  # rejection sampling's greedy rule, with the C argmax (~6x torch's over 49k)
        return _matching(draft, argmax(probs), torch.arange(len(probs)))
    # The engine made these distributions with softmax from finite weights (checked at load and
    # swap): the per-step value scan (sum to 1, no NaN) would cost about as much as the sampling.
    accepted, emitted = rejection_sample(draft.tokens, draft.probs, probs, uniforms, sampler.greedy, draft.lengths,
                                         check_values=False)
    coupled = sampler.coupled.nonzero().squeeze(1)
    # t = inverse-CDF(p, u) at every position; without drafts rejection sampling drew exactly that already
    # (inverse_cdf_sample of p_1 with u_1), so a plain step does not draw its seeded rows twice
    if coupled.numel() and draft.tokens.shape[1]:
        accepted[coupled], emitted[coupled] = _matching(draft, inverse_cdf_sample(probs[coupled], uniforms[coupled]),
                                                        coupled)
    return accepted, emitted


def _matching(draft: Draft, t: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts accepted while they equal t, the step emitting t up to the first mismatch: the
    coupled rule (t the seed's inverse-CDF tokens) and the greedy one (t the argmax). t [R, K+1]
    int64 for `rows` [R] -> accepted [R], emitted [R, K+1] (-1 after each row's accepted + 1)."""
    k = draft.tokens.shape[1]
    if not k:  # no drafts (a plain step): each row emits t, accepting nothing (the ops below cost ~40 us a step)
        return torch.zeros(len(rows), dtype=torch.long), t
    lengths = draft.lengths[rows] if draft.lengths is not None else torch.full((len(rows),), k)
    valid = torch.arange(k)[None, :] < lengths[:, None]
    accepted = ((draft.tokens[rows] == t[:, :k]) & valid).long().cumprod(-1).sum(-1)
    keep = torch.arange(k + 1)[None, :] <= accepted[:, None]
    return accepted, torch.where(keep, t, torch.full_like(t, -1))
