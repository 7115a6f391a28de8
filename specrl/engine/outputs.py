"""What the engine hands out: per-step outputs to stream, whole completions, counters.

Both serving backends produce these (the vLLM backend builds them from vLLM's outputs), so the
HTTP layer and the benchmarks read one shape.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specrl.speculation.quantities import SpecCounts


@dataclass
class StepOutput:
    """What one step produced for one request: tokens to stream and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    target_version: str
    drafter_version: str
    # per new token, when requested: (log-prob of the token, [(id, log-prob) of the top n])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class EngineStats:
    """Counters since start, read by /metrics (vLLM's spec-decode names) and benchmarks."""

    spec: SpecCounts = field(default_factory=SpecCounts)
    by_proposer: dict[str, SpecCounts] = field(default_factory=dict)  # the drafting steps of each proposer
    generated_tokens: int = 0
    prompt_tokens: int = 0
    # Prefix reuse as vLLM counts it, in prompt tokens of new requests (a KV recompute is no query):
    # looked up in the prefix cache, and found there; prompt positions the target prefilled itself.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_computed: int = 0
    # Speed-up over plain decoding, estimated live: decode steps' wall time, and what plain decoding
    # would have taken for the same tokens (tokens / B plain steps at the measured plain step cost).
    decode_seconds: float = 0.0
    plain_equivalent_seconds: float = 0.0
    # Computed twice (the effective-token yield, specrl/telemetry/token_use.py): prompt positions
    # prefilled although an earlier prompt had the same prefix (prefix cache off, or its KV gone),
    # and positions recomputed when an interrupting policy swap moved a sequence to new weights.
    prompt_tokens_repeated: int = 0
    kv_recomputed_tokens: int = 0
    seen_prefixes: "SeenPrefixes" = field(default_factory=lambda: SeenPrefixes(), repr=False)

    def count(self, proposer: str, k: int, accepted: int) -> None:
        """One verify step of one sequence (k = 0: proposer "")."""
        self.spec.count(k, accepted)
        if k > 0:
            self.by_proposer.setdefault(proposer, SpecCounts()).count(k, accepted)

    def count_prefill(self, prompt_ids: list[int], start: int, end: int, recompute: bool) -> None:
        """Positions [start, end) prefilled: a KV recompute, or prompt positions of which those in
        blocks an earlier prompt already had are counted as repeated."""
        if recompute:
            self.kv_recomputed_tokens += end - start
            return
        self.prompt_tokens_repeated += self.seen_prefixes.repeated(prompt_ids, start, end)


class SeenPrefixes:
    """Hashes of the prompt prefixes seen so far, in whole blocks of BLOCK tokens (a bounded LRU of
    `capacity` blocks): which prefilled positions an earlier prompt had computed already. A
    prompt's blocks join when its prefill ends, so its own chunks never count against it; the
    partial last block never counts (an undercount of at most BLOCK - 1 positions per prompt)."""

    BLOCK = 16

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _chain(self, prompt_ids: list[int], blocks: int) -> list[int]:
        """Hashes of the first `blocks` whole blocks, each over the whole prefix through it."""
        out, h = [], 0
        for b in range(blocks):
            h = hash((h, tuple(prompt_ids[b * self.BLOCK:(b + 1) * self.BLOCK])))
            out.append(h)
        return out

    def repeated(self, prompt_ids: list[int], start: int, end: int) -> int:
        """-> how many of positions [start, end) lie in blocks seen before (then, at the prompt's
        end, its blocks join)."""
        chain = self._chain(prompt_ids, min(end, len(prompt_ids)) // self.BLOCK)
        repeated = sum(max(0, min(end, (b + 1) * self.BLOCK) - max(start, b * self.BLOCK))
                       for b, h in enumerate(chain) if (b + 1) * self.BLOCK > start and h in self._blocks)
        if end >= len(prompt_ids):
            for h in chain:
                self._blocks[h] = None
                self._blocks.move_to_end(h)
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        return repeated


@dataclass
class Completion:
    """A finished request (`Engine.generate`)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    spec: SpecCounts  # its verify steps; the prefill's first token counts as one step of k = 0
    target_version: str
    drafter_version: str
    version_runs: list[list]  # [first output index, target version, drafter version]
