"""Sampling parameters of a request, and per-row sampling over a batch.

temperature == 0 means greedy. Every row draws its randomness from its own generator (seeded
by the request's `seed`, else by the engine), so one request's draws never depend on which
other requests share the batch.

A request with a `seed` is reproducible whatever speculation does: its randomness is a stream of
uniforms indexed by position (`position_uniforms`, drawn once from the seed), and its token at
position n is always the inverse-CDF draw of the target's distribution with u_n
(`specrl.speculation.verify`: drafts only decide how many of those tokens one step yields). Without a
seed, a row's uniforms come one after another from its generator.

The distribution a row samples from (`RowSampler.probs`), in vLLM's order: the logit processing
that depends on the request's tokens (`specrl.speculation.processing`: logit bias, min_tokens,
repetition / frequency / presence penalties), then temperature, min_p, top_k and top_p. Greedy
rows take the argmax after the processing (temperature, min_p, top_k and top_p leave it alone).
top_k = 0 or -1 keeps every token (vLLM's convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specrl.errors import InvalidRequestError
from specrl.models.linear import cpu_kernels
from specrl.models.llama import argmax
from specrl.speculation.processing import LogitAdjust


MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's and vLLM's bound)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's log-prob and the top n
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are generated
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    # text assembly (the serving layer) and stop-string checks
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and 0 <= self.temperature <= 2):
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature!r}", param="temperature")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs!r}", param="top_logprobs")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", param="stop")
        self._check_processing()

    def _check_processing(self) -> None:
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}",
                                      param="top_k")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}",
                                      param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}", param=name)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                                      f"{self.min_tokens!r}", param="min_tokens")
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            if not (_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}",
                                          param="logit_bias")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids, got {list(self.stop_token_ids)!r}",
                                      param="stop_token_ids")

    def check_vocab(self, vocab: int) -> None:
        """Raise InvalidRequestError if logit_bias or stop_token_ids name a token outside [0, vocab)."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise InvalidRequestError(f"{name} names token ids outside the vocabulary [0, {vocab}): {outside[:5]}",
                                          param=name)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RowSampler:
    """Sampling rules of the B rows of a batch.

    temperature [B] float32 (0 for greedy rows), top_p [B] float32, greedy [B] bool,
    generators: one torch.Generator per row. top_k [B] int64 (0: off) and min_p [B] float32
    (0: off) exist only when some sampled row uses them, `adjust` only when some row asks for the
    token-dependent processing (specrl.speculation.processing): a default batch costs what it always did.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    generators: list[torch.Generator] = field(repr=False)
    streams: list[torch.Tensor | None] | None = field(default=None, repr=False)  # per row: uniforms by position
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    adjust: LogitAdjust | None = field(default=None, repr=False)

    @classmethod
    def of(cls, params: list[SamplingParams], generators: list[torch.Generator],
           streams: list[torch.Tensor | None] | None = None,
           history: list[tuple[list[int], list[int]]] | None = None) -> "RowSampler":
        """history: per row (prompt ids, generated ids), which the penalties and min_tokens read."""
        top_k = [0 if p.greedy or p.top_k < 0 else p.top_k for p in params]
        min_p = [0.0 if p.greedy else p.min_p for p in params]
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32),
                   torch.tensor([p.greedy for p in params]), generators, streams,
                   torch.tensor(top_k, dtype=torch.long) if any(top_k) else None,
                   torch.tensor(min_p, dtype=torch.float32) if any(min_p) else None,
                   LogitAdjust.of(params, history))

    def select(self, rows: list[int]) -> "RowSampler":
        """The sampler of a subset of the rows (in that order)."""
        index = torch.tensor(rows, dtype=torch.long)
        return RowSampler(self.temperature[index], self.top_p[index], self.greedy[index],
                          [self.generators[b] for b in rows],
                          None if self.streams is None else [self.streams[b] for b in rows],
                          None if self.top_k is None else self.top_k[index],
                          None if self.min_p is None else self.min_p[index],
                          None if self.adjust is None else self.adjust.select(rows))

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @property
    def draws_from_logits(self) -> bool:
        """Whether a plain step (no drafts) can take each row's token straight from its logits (`draw`): some row
        samples, and no row asks for the token-dependent processing, min_p or top_p, or is seeded (a seeded row's
        token is the inverse-CDF draw of `probs`, which its speculative steps draw too: the same text with or without
        speculation); and the C sampler is built. top_k is drawn in C too."""
        if cpu_kernels is None or self.all_greedy or self.adjust is not None or self.min_p is not None \
                or bool((self.top_p < 1).any()):
            return False
        return self.streams is None or all(s is None for s in self.streams)

    def draw(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] float32, uniforms [B] in [0, 1) -> (tokens [B] int64, log normaliser [B] float32) (where
        `draws_from_logits`): greedy rows their argmax, sampled rows the inverse-CDF draw of softmax(logits /
        temperature) over the ids their top_k keeps, with their uniform, as `distribution` and kernels/verify.py
        draw it, and log sum exp(logits / temperature) over those ids (a greedy row's at temperature 1, every id),
        in two C passes a row (and a quickselect for top_k) (`_cpu_kernels.sample_rows`: 0.042 ms for
        one 49k row, 0.131 for 8, where torch's softmax, cumsum and searchsorted took 0.304 and 1.085: bench kernels)."""
        logits = logits.float().contiguous()
        rows, vocab = logits.shape
        tokens, log_normaliser = torch.empty(rows, dtype=torch.long), torch.empty(rows)
        inverse = (1.0 / torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)).contiguous()
        uniforms = uniforms.float().contiguous()
        top_k = None if self.top_k is None else self.top_k.contiguous()  # 0 where off (greedy rows too)
        cpu_kernels.sample_rows(tokens.data_ptr(), log_normaliser.data_ptr(), logits.data_ptr(), rows, vocab,
                                inverse.data_ptr(), uniforms.data_ptr(), 0 if top_k is None else top_k.data_ptr(),
                                torch.get_num_threads())
        if bool(self.greedy.any()):
            greedy = self.greedy.nonzero().squeeze(1)
            tokens[greedy] = argmax(logits.index_select(0, greedy))
        return tokens, log_normaliser

    @property
    def coupled(self) -> torch.Tensor:
        """[B] bool: sampled rows with a position-indexed stream (seeded requests)."""
        seeded = [s is not None for s in self.streams] if self.streams is not None else [False] * len(self.generators)
        return torch.tensor(seeded, dtype=torch.bool) & ~self.greedy

    def draft_uniforms(self, row: int, n: int) -> list[float] | None:
        """n uniforms from row's generator to draw a sampled suffix draft (suffix_index.py), or None
        for a row whose suffix drafts stay the most voted tokens: greedy rows (only the argmax is
        accepted), and seeded rows, whose coupled rule accepts a draft iff it equals the seed's
        token (verify.py), so a draft of its own randomness would gain nothing."""
        if bool(self.greedy[row]) or (self.streams is not None and self.streams[row] is not None):
            return None
        return torch.rand(n, generator=self.generators[row]).tolist()

    def uniforms(self, n: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """-> [B, n] float32 in [0, 1). positions [B] int64: the position of column 0 of each
        row; a row with a stream reads its uniforms at positions[b] .. positions[b]+n-1, any
        other row takes the next n from its generator."""
        rows = []
        for b, g in enumerate(self.generators):
            stream = self.streams[b] if self.streams is not None else None
            if stream is not None and positions is not None:
                rows.append(stream[int(positions[b]): int(positions[b]) + n])
            else:
                rows.append(torch.rand(n, generator=g))
        return torch.stack(rows)

    def probs(self, logits: torch.Tensor, tokens: torch.Tensor | None = None, eos_ids: tuple[int, ...] = (),
              columns: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, T, V'] -> the distributions [B, T, V'] float32 the rows sample from: `adjusted`,
        then `distribution`. tokens, eos_ids, columns: as `adjusted`."""
        return self.distribution(self.adjusted(logits, tokens, eos_ids, columns))

    def adjusted(self, logits: torch.Tensor, tokens: torch.Tensor | None = None, eos_ids: tuple[int, ...] = (),
                 columns: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, T, V'] float32 after the token-dependent processing (the same tensor when no row
        asks for it). tokens [B, J] int64: tokens generated since the rows' history, position t
        following the first J - T + 1 + t of them (a verify step: its drafts); eos_ids: the model's
        EOS ids (min_tokens holds them back); columns [V'] int64: the target ids of the columns
        (the drafter's reduced vocabulary). Greedy rows take the argmax of these logits."""
        if self.adjust is None:
            return logits
        return self.adjust.apply(logits, tokens, eos_ids, columns)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """adjusted logits [B, T, V] -> probabilities [B, T, V] float32 after temperature, min_p, top_k
        and top_p. Greedy rows get temperature 1 and no filter (only their argmax is ever used)."""
        temperature = torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)
        probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
        if self.min_p is not None:
            probs = torch.where((self.min_p > 0)[:, None, None], min_p_filter(probs, self.min_p), probs)
        if self.top_k is not None:
            probs = torch.where((self.top_k > 0)[:, None, None], top_k_filter(probs, self.top_k), probs)
        if bool((self.top_p < 1).any()):
            probs = top_p_filter(probs, self.top_p)
        return probs


def position_uniforms(seed: int, length: int) -> torch.Tensor:
    """A seeded request's randomness: [length] float32 uniforms, entry n for the token at position n."""
    return torch.rand(length, generator=torch.Generator().manual_seed(seed))


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [B, T, V], top_p [B] -> renormalised probs keeping the smallest set of tokens whose
    mass reaches top_p (the most likely token is always kept); rows with top_p >= 1 unchanged.

    The set is found among the c most likely tokens, c doubling from 64 until every filtered row's
    candidates reach its top_p (a sort once c passes V/8): a full sort of SmolLM2's 49k vocabulary
    costs ~3 ms a row, and its nucleus at top_p 0.9-0.95 is a median ~10 tokens, rarely above 500."""
    v = probs.shape[-1]
    filtered = top_p < 1
    c = min(64, v)
    while True:
        if 8 * c > v:  # a wide set: one sort beats a top-k of that many
            values, order = probs.sort(dim=-1, descending=True)
            mass_before = values.cumsum(-1) - values
            break
        values, order = probs.topk(c, dim=-1)  # [B, T, c], descending
        mass_before = values.cumsum(-1) - values
        reached = (mass_before[..., -1] + values[..., -1] >= top_p[:, None]) | ~filtered[:, None]
        if bool(reached.all()):
            break
        c *= 2
    values = values.masked_fill(mass_before >= top_p[:, None, None], 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, values)
    return torch.where(filtered[:, None, None], kept / kept.sum(-1, keepdim=True), probs)


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs [B, T, V], min_p [B] -> renormalised probs without the tokens less likely than min_p
    times the most likely one (vLLM's rule)."""
    floor = probs.amax(-1, keepdim=True) * min_p[:, None, None]
    kept = probs.masked_fill(probs < floor, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def top_k_filter(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """probs [B, T, V], top_k [B] int64 (>= 1 where used) -> renormalised probs keeping the top_k
    most likely tokens (and any tied with the k-th, as vLLM keeps them)."""
    k = top_k.clamp(1, probs.shape[-1])
    values = probs.topk(int(k.max()), dim=-1).values  # [B, T, k_max], descending
    kth = values.gather(-1, (k - 1)[:, None, None].expand(-1, probs.shape[1], 1))
    kept = probs.masked_fill(probs < kth, 0.0)
    return kept / kept.sum(-1, keepdim=True)
