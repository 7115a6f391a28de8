"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specrl.speculation.quantities import SpecCounts
from specrl.speculation.sampling import SamplingParams
from specrl.telemetry.segments import SegmentWriter


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Positions: the prompt fills 0..n-1. `num_computed` positions have their KV in the cache;
    `pending_token` (the last committed token) is the next input. The drafter lags behind: its
    `draft_pending_*` lists hold (target feature at position p, token at p+1) for positions
    p = draft_start, draft_start+1, ... that it has not consumed yet."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator = field(repr=False)
    segments: SegmentWriter = field(repr=False)
    status: Status = Status.WAITING
    slot: int = -1
    num_computed: int = 0
    pending_token: int = -1
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    draft_start: int = 0
    draft_pending_features: list[torch.Tensor] = field(default_factory=list, repr=False)
    draft_pending_tokens: list[int] = field(default_factory=list)
    spec: SpecCounts = field(default_factory=SpecCounts)  # this request's verify steps
    suffix: object | None = field(default=None, repr=False)  # its context in the suffix index (prompt + output)
    prompt_key: int = 0  # hash of prompt_ids: running sequences with the same one draft from each other's text
    stream: torch.Tensor | None = field(default=None, repr=False)  # a seeded request's uniforms by position
    # Weights: the target version this sequence runs on, and runs of versions over its output:
    # [first output index, target version, drafter version] appended whenever either changes.
    target_version: str = ""
    version_runs: list[list] = field(default_factory=list)
    # Prefill covers context positions [num_computed, prefill_end): the prompt, or after an
    # interrupting policy swap the whole context but the pending token (KV recompute).
    prefill_end: int = 0
    # Prompt positions whose KV came from the prefix cache (specrl/engine/prefix_cache.py) instead
    # of being computed, set when its first prefill is placed (vLLM's num_cached_tokens); None before.
    num_cached_tokens: int | None = None

    def __post_init__(self):
        self.prefill_end = len(self.prompt_ids)
        self.prompt_key = hash(tuple(self.prompt_ids))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def context_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        n = len(self.prompt_ids)
        return (self.prompt_ids[start:end] if end <= n else
                self.prompt_ids[start:] + self.output_ids[max(start - n, 0): end - n])

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
