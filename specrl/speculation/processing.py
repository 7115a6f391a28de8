"""Logit processing that depends on a request's tokens so far: logit bias, min_tokens' hold on the
stop tokens, and the repetition, frequency and presence penalties (vLLM's definitions, in vLLM's
order: bias, min_tokens, then penalties; all before temperature, so they change greedy too).

- logit_bias: the bias is added to the token's logit.
- min_tokens: while fewer than min_tokens tokens are generated, the EOS ids and the request's
  stop_token_ids get -inf (EOS is held back even with ignore_eos, as vLLM does).
- repetition_penalty r, on tokens in the prompt or generated so far: a positive logit is divided
  by r, a negative one multiplied by r.
- frequency_penalty f, presence_penalty p, on generated tokens only: logit -= f * count + p * [count > 0].

Where the tokens come from (the speculative step): position t of logits [B, T, V] is the
distribution of the token after the row's history and the first J - T + 1 + t of `tokens` [B, J]
(J >= T - 1). In a verify step (T = K + 1, J = K) position i counts the drafts d_1..d_i it follows
as generated, which they are if accepted; a drafting pass (T = 1) counts every token drafted so
far. So every distribution a step uses is the one plain decoding would use after the same tokens,
and speculation stays exact under every rule of specrl.speculation.verify.

Only the rows that ask for any of this are touched (`rows`); a batch where none does has no
`LogitAdjust` at all (RowSampler.adjust is None), so default requests pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def adjusts(params, generated: int) -> bool:
    """Whether a request with these SamplingParams and `generated` tokens so far needs processing."""
    return bool(params.logit_bias or params.repetition_penalty != 1.0 or params.presence_penalty
                or params.frequency_penalty or params.min_tokens > generated)


@dataclass
class LogitAdjust:
    """The rows [R] of a batch that adjust their logits, with what they need: their SamplingParams,
    prompt ids and generated ids (lists, read when applied)."""

    rows: torch.Tensor  # [R] int64, batch rows
    params: list
    prompts: list[list[int]]
    outputs: list[list[int]]

    @classmethod
    def of(cls, params: list, history: list[tuple[list[int], list[int]]] | None) -> "LogitAdjust | None":
        """history: per row (prompt ids, generated ids); None: no tokens yet. -> None when no row adjusts."""
        history = history if history is not None else [([], [])] * len(params)
        rows = [b for b, p in enumerate(params) if adjusts(p, len(history[b][1]))]
        if not rows:
            return None
        return cls(torch.tensor(rows, dtype=torch.long), [params[b] for b in rows], [history[b][0] for b in rows],
                   [history[b][1] for b in rows])

    def select(self, rows: list[int]) -> "LogitAdjust | None":
        """The adjustment of a subset of the batch rows, renumbered in that order."""
        where = {b: i for i, b in enumerate(rows)}
        keep = [j for j, b in enumerate(self.rows.tolist()) if b in where]
        if not keep:
            return None
        return LogitAdjust(torch.tensor([where[int(self.rows[j])] for j in keep], dtype=torch.long),
                           [self.params[j] for j in keep], [self.prompts[j] for j in keep],
                           [self.outputs[j] for j in keep])

    def apply(self, logits: torch.Tensor, tokens: torch.Tensor | None = None, eos_ids: tuple[int, ...] = (),
              columns: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, T, V'] float32 -> a new tensor with the rows' logits processed (the others as
        they were). tokens [B, J] int64: tokens generated after the history (see the module
        docstring; None: J = 0, so T must be 1). columns [V'] int64: the target ids of the logits'
        columns (the drafter's reduced vocabulary; None: column x is token x)."""
        _, t, width = logits.shape
        j = 0 if tokens is None else tokens.shape[1]
        if j < t - 1:
            raise ValueError(f"{t} positions need at least {t - 1} tokens after the history, got {j}")
        vocab = width if columns is None else int(columns.max()) + 1  # ids past the last column matter nowhere
        cols = torch.arange(width) if columns is None else columns
        before = j - t + 1  # tokens every position follows
        extra = tokens.index_select(0, self.rows) if j else torch.zeros(len(self.params), 0, dtype=torch.long)
        x = logits.index_select(0, self.rows)
        self._bias(x, vocab, cols)
        self._min_tokens(x, vocab, cols, before, eos_ids)
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in self.params):
            x = self._penalties(x, vocab, cols, extra, before)
        return logits.index_copy(0, self.rows, x)

    def _bias(self, x: torch.Tensor, vocab: int, cols: torch.Tensor) -> None:
        if not any(p.logit_bias for p in self.params):
            return
        bias = torch.zeros(len(self.params), vocab)
        for r, p in enumerate(self.params):
            for token, value in p.logit_bias:
                if token < vocab:
                    bias[r, token] = value
        x += bias[:, None, cols]

    def _min_tokens(self, x: torch.Tensor, vocab: int, cols: torch.Tensor, before: int, eos_ids) -> None:
        """Stop tokens get -inf at the positions that fill an output index below min_tokens."""
        t = x.shape[1]
        generated = torch.tensor([len(o) + before for o in self.outputs])[:, None] + torch.arange(t)[None]  # [R, T]
        held = generated < torch.tensor([p.min_tokens for p in self.params])[:, None]
        if not bool(held.any()):
            return
        stops = torch.zeros(len(self.params), vocab, dtype=torch.bool)
        for r, p in enumerate(self.params):
            ids = [i for i in (*eos_ids, *p.stop_token_ids) if i < vocab]
            stops[r, ids] = True
        x.masked_fill_(held[:, :, None] & stops[:, None, cols], NEG_INF)

    def _penalties(self, x: torch.Tensor, vocab: int, cols: torch.Tensor, extra: torch.Tensor,
                   before: int) -> torch.Tensor:
        """Repetition (prompt + generated), then frequency and presence (generated) penalties, with
        position t counting the generated history, extra[:, :before + t]."""
        r, t, _ = x.shape
        counts = torch.zeros(r, vocab)
        in_prompt = torch.zeros(r, vocab, dtype=torch.bool)
        for i, (prompt, output) in enumerate(zip(self.prompts, self.outputs)):
            ids = torch.tensor([*output, *extra[i, :before].tolist()], dtype=torch.long)
            ids = ids[ids < vocab]
            counts[i] = torch.bincount(ids, minlength=vocab)[:vocab].float()
            prompt_ids = torch.tensor(prompt, dtype=torch.long)
            in_prompt[i, prompt_ids[prompt_ids < vocab]] = True
        counts = counts[:, None].repeat(1, t, 1)  # [R, T, vocab]
        if t > 1:  # position s also counts the window's tokens before it
            window = extra[:, before: before + t - 1]
            valid = (window < vocab).float()
            step = torch.zeros(r, t, vocab)
            step[:, 1:].scatter_add_(2, window.clamp(max=vocab - 1)[..., None], valid[..., None])
            counts += step.cumsum(1)
        counts = counts.index_select(2, cols)
        seen = counts > 0
        repetition = torch.tensor([p.repetition_penalty for p in self.params])[:, None, None]
        penalty = torch.where(seen | in_prompt.index_select(1, cols)[:, None], repetition, torch.ones(()))
        x = torch.where(x > 0, x / penalty, x * penalty)
        frequency = torch.tensor([p.frequency_penalty for p in self.params])[:, None, None]
        presence = torch.tensor([p.presence_penalty for p in self.params])[:, None, None]
        return x - frequency * counts - presence * seen.float()
