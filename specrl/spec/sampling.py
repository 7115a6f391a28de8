"""Sampling parameters of a request, and per-row sampling over a batch.

temperature == 0 means greedy. Every row draws its randomness from its own generator (seeded
by the request's `seed`, else by the engine), so one request's draws never depend on which
other requests share the batch.

A request with a `seed` is reproducible whatever speculation does: its randomness is a stream of
uniforms indexed by position (`position_uniforms`, drawn once from the seed), and its token at
position n is always the inverse-CDF draw of the target's distribution with u_n
(`specrl.spec.verify`: drafts only decide how many of those tokens one step yields). Without a
seed, a row's uniforms come one after another from its generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specrl.errors import InvalidRequestError


MAX_TOP_LOGPROBS = 20


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


@dataclass
class RowSampler:
    """Sampling rules of the B rows of a batch.

    temperature [B] float32 (0 for greedy rows), top_p [B] float32, greedy [B] bool,
    generators: one torch.Generator per row.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    generators: list[torch.Generator] = field(repr=False)
    streams: list[torch.Tensor | None] | None = field(default=None, repr=False)  # per row: uniforms by position

    @classmethod
    def of(cls, params: list[SamplingParams], generators: list[torch.Generator],
           streams: list[torch.Tensor | None] | None = None) -> "RowSampler":
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32),
                   torch.tensor([p.greedy for p in params]), generators, streams)

    def select(self, rows: list[int]) -> "RowSampler":
        """The sampler of a subset of the rows (in that order)."""
        index = torch.tensor(rows, dtype=torch.long)
        return RowSampler(self.temperature[index], self.top_p[index], self.greedy[index],
                          [self.generators[b] for b in rows],
                          None if self.streams is None else [self.streams[b] for b in rows])

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @property
    def coupled(self) -> torch.Tensor:
        """[B] bool: sampled rows with a position-indexed stream (seeded requests)."""
        seeded = [s is not None for s in self.streams] if self.streams is not None else [False] * len(self.generators)
        return torch.tensor(seeded, dtype=torch.bool) & ~self.greedy

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

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, T, V] -> probabilities [B, T, V] float32 after temperature and top-p.
        Greedy rows get temperature 1 (only their argmax is ever used)."""
        temperature = torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)
        probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
        filtered = self.top_p < 1
        if bool(filtered.any()):  # only those rows: a cumulative sum can round past 1.0
            probs = torch.where(filtered[:, None, None], top_p_filter(probs, self.top_p), probs)
        return probs


def position_uniforms(seed: int, length: int) -> torch.Tensor:
    """A seeded request's randomness: [length] float32 uniforms, entry n for the token at position n."""
    return torch.rand(length, generator=torch.Generator().manual_seed(seed))


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [B, T, V], top_p [B] -> renormalised probs keeping the smallest set of tokens whose
    mass reaches top_p (the most likely token is always kept)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None, None], 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)
