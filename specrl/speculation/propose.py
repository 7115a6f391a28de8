"""Propose: the drafts of one verify step, from the learned head and the suffix index.

The head (EAGLE) first catches up on the target features of the positions verified since its
last turn, then drafts k tokens for each of its rows. The suffix index's drafts are the most voted
tokens (q is one-hot at the drafted token), or for a sampled row drawn from the votes (q is the
vote distribution: suffix_index.py, "Sampled drafts"). `assemble` puts both into one `Draft` padded to the step's
width, each row with its own length (kernels/verify.py: the padding convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.kernels import inverse_cdf_sample
from specrl.models.drafter import EagleDrafter
from specrl.models.kv_cache import CacheBatch, KVCache
from specrl.models.linear import cpu_kernels
from specrl.speculation.sampling import RowSampler
from specrl.speculation.suffix_index import SuffixDraft


@dataclass
class Draft:
    """tokens [B, K] int64 (target ids; entries past a row's length are padding); probs [B, K, V]
    float32 in the target vocabulary, the distributions the tokens were drawn from (None when every
    row is greedy); logprobs [B, K] float32, log q of each drafted token (temperature 1 for greedy
    rows; for the suffix index's, the log vote share of a sampled draft, 0 for a most-voted one);
    lengths [B] int64, each row's draft length (None: all K)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    logprobs: torch.Tensor
    lengths: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch: int) -> "Draft":
        return cls(torch.zeros(batch, 0, dtype=torch.long), None, torch.zeros(batch, 0))

    def rows(self) -> list[tuple[list[int], list[float]]]:
        """Each row's draft tokens and their log q (one conversion for the step: a row's own
        slicing and `tolist` cost ~8 us a row, ~0.06 ms a step at B = 8)."""
        batch, width = self.tokens.shape
        if width == 0:
            return [([], []) for _ in range(batch)]
        lengths = [width] * batch if self.lengths is None else self.lengths.tolist()
        return [(tokens[:n], logprobs[:n]) for tokens, logprobs, n
                in zip(self.tokens.tolist(), self.logprobs.tolist(), lengths)]


def assemble(width: int, lengths: list[int], head_rows: list[int], head: Draft | None,
             suffix: list[SuffixDraft | None], vocab_size: int, with_probs: bool) -> Draft:
    """One step's Draft of B rows padded to `width`: rows in `head_rows` take `head`'s rows (in that
    order), the others the first lengths[b] tokens of suffix[b]. with_probs: build probs [B, K, V]
    (some row samples): the head's q; for suffix tokens the votes they were drawn from (a sampled
    draft) or one-hot (the most voted token)."""
    batch = len(lengths)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    logprobs = torch.zeros(batch, width)
    probs = torch.zeros(batch, width, vocab_size) if with_probs and width > 0 else None
    from_head = {b: i for i, b in enumerate(head_rows)}
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        if b in from_head:
            i = from_head[b]
            tokens[b, :n], logprobs[b, :n] = head.tokens[i, :n], head.logprobs[i, :n]
            if probs is not None and head.probs is not None:
                probs[b, :n] = head.probs[i, :n]
        else:
            tokens[b, :n] = torch.tensor(suffix[b].tokens[:n])
            if suffix[b].sampled:
                logprobs[b, :n] = torch.tensor(suffix[b].confidences[:n]).log()
                if probs is not None:
                    for j, (ids, shares) in enumerate(suffix[b].votes[:n]):
                        probs[b, j, ids] = torch.tensor(shares)
                continue
        if probs is not None and (b not in from_head or head.probs is None):  # deterministic drafts
            probs[b, torch.arange(n), tokens[b, :n]] = 1.0
    return Draft(tokens, probs, logprobs, torch.tensor(lengths, dtype=torch.long))


def catch_up(drafter: EagleDrafter, cache: KVCache, slots: torch.Tensor, start: torch.Tensor,
             features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Feed the drafter the target's real features for positions it has not seen.

    features [B, P, H] float32 (target hidden at drafter positions start[b]..), tokens [B, P]
    int64 (the token after each of those positions); rows shorter than P are right-padded
    (their padded entries land beyond the real ones and are overwritten before anyone reads
    them). -> drafter hidden [B, P, H]."""
    return drafter(features, tokens, slots, start, cache)


def propose(drafter: EagleDrafter, cache: KVCache, slots: torch.Tensor, start: torch.Tensor,
            features: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, k: int,
            sampler: RowSampler, positions: torch.Tensor) -> Draft:
    """Draft k tokens for each of B sequences.

    slots [B] int64; start [B] int64, drafter position of each row's first pending entry;
    features [B, P, H], tokens [B, P]: pending entries (see `catch_up`), lengths [B] how many
    are real; positions [B] int64: the sequence position the first draft would fill (a seeded
    row drafts with the uniforms of the positions it drafts for: specrl.speculation.verify). The
    catch-up pass yields the first draft; each further draft is one pass over the drafter's own
    predicted hidden state and the token it just drafted."""
    rows = torch.arange(len(slots))
    hidden = catch_up(drafter, cache, slots, start, features, tokens)[rows, lengths - 1]  # [B, H]
    batch = CacheBatch(cache, slots, start + lengths, 1) if k > 1 else None  # the further passes', advanced a pass
    out_tokens, out_probs, out_logprobs = [], [], []
    eos_ids = drafter.target.cfg.eos_token_ids
    all_greedy = sampler.all_greedy
    for i in range(k):
        # the head's logits [B, V_d], processed as the target's are, the tokens drafted so far counted as generated
        logits = drafter.logits(hidden)
        if sampler.adjust is not None:
            drafted = torch.stack(out_tokens, 1) if out_tokens else None
            logits = sampler.adjusted(logits[:, None], drafted, eos_ids, drafter.draft_to_target)[:, 0]
        if all_greedy:  # the argmax alone: no distribution, no uniforms (~0.2 ms a draft token)
            draft_ids, logprobs = argmax_logprob(logits)
            out_logprobs.append(logprobs)
        else:
            probs = sampler.distribution(logits[:, None])[:, 0]
            uniforms = sampler.uniforms(1, positions + i)[:, 0]
            draft_ids = torch.where(sampler.greedy, logits.argmax(-1), inverse_cdf_sample(probs, uniforms))
            out_logprobs.append(probs[rows, draft_ids].log())
            out_probs.append(_to_target_vocab(drafter, probs))
        token = drafter.to_target_ids(draft_ids)
        out_tokens.append(token)
        if i + 1 < k:
            if i:
                batch.advance()
            hidden = drafter.step(hidden, token, batch)
    if k == 0:
        return Draft.empty(len(slots))
    return Draft(torch.stack(out_tokens, 1), torch.stack(out_probs, 1) if out_probs else None,
                 torch.stack(out_logprobs, 1))


def argmax_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (ids [B] int64, the first index of each row's max as torch's argmax gives it;
    logprobs [B] float32, log softmax of the row there): a greedy draft and its log q at temperature 1. One
    C pass a row where built (`_cpu_kernels.argmax_logprob_rows`: torch's argmax + logsumexp took ~60 of a
    ~350 us drafter pass at B = 1)."""
    if cpu_kernels is None or not logits.is_contiguous() or logits.dtype != torch.float32:
        ids = logits.argmax(-1)
        return ids, torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
    ids, logprobs = torch.empty(logits.shape[0], dtype=torch.long), torch.empty(logits.shape[0])
    cpu_kernels.argmax_logprob_rows(ids.data_ptr(), logprobs.data_ptr(), logits.data_ptr(), *logits.shape)
    return ids, logprobs


def _to_target_vocab(drafter: EagleDrafter, probs: torch.Tensor) -> torch.Tensor:
    """probs [B, V_d] -> [B, V] (zero outside the draft vocabulary)."""
    if drafter.draft_to_target is None:
        return probs
    full = probs.new_zeros(probs.shape[0], drafter.cfg.vocab_size)
    return full.index_copy_(1, drafter.draft_to_target, probs)
