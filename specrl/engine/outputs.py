"""What the engine hands out: per-step outputs to stream, whole completions, counters.

Both serving backends produce these (the vLLM backend builds them from vLLM's outputs), so the
HTTP layer and the benchmarks read one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specrl.spec.quantities import SpecCounts


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
    # Speed-up over plain decoding, estimated live: decode steps' wall time, and what plain decoding
    # would have taken for the same tokens (tokens / B plain steps at the measured plain step cost).
    decode_seconds: float = 0.0
    plain_equivalent_seconds: float = 0.0

    def count(self, proposer: str, k: int, accepted: int) -> None:
        """One verify step of one sequence (k = 0: proposer "")."""
        self.spec.count(k, accepted)
        if k > 0:
            self.by_proposer.setdefault(proposer, SpecCounts()).count(k, accepted)


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
