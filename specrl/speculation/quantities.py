"""The spec-decode quantities, defined once; vLLM's names where vLLM has them.

A verify step of one sequence drafts k >= 0 tokens and emits accepted + 1 tokens: the accepted
drafts plus the target's own token (recovered at the first rejection, or the bonus token when
all k passed). Counters, summed over steps and sequences:

- num_steps: verify steps, k = 0 included (a plain decode step is a verify step of k = 0);
- num_drafts: verify steps that drafted (k > 0)                  (vLLM: spec_decode_num_drafts);
- num_draft_tokens: drafted tokens, sum of k                     (vLLM: spec_decode_num_draft_tokens);
- num_accepted_tokens: accepted drafts                           (vLLM: spec_decode_num_accepted_tokens);
- num_accepted_tokens_per_pos[i]: steps whose draft i was accepted (vLLM: ..._per_pos{position=i}).

Derived:

- mean_acceptance_length = 1 + accepted / num_drafts: tokens per *drafting* step (vLLM's
  definition; None when nothing was drafted);
- tokens_per_step = (num_steps + accepted) / num_steps: tokens per verify step, k = 0 steps
  included; 1.0 means speculation gained nothing. This is what decoding speed follows;
- acceptance_rate = accepted / num_draft_tokens: the fraction of drafted tokens accepted;
- per-position acceptance rate i = num_accepted_tokens_per_pos[i] / num_drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounts:
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def count(self, k: int, accepted: int) -> None:
        """One verify step of one sequence that drafted k tokens and had `accepted` of them accepted."""
        self.num_steps += 1
        if k > 0:
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            per_pos = self.num_accepted_tokens_per_pos
            if len(per_pos) < k:
                per_pos += [0] * (k - len(per_pos))
            for i in range(accepted):
                per_pos[i] += 1

    def add(self, other: "SpecCounts") -> None:
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < len(other.num_accepted_tokens_per_pos):
            per_pos += [0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[i] += n

    def copy(self) -> "SpecCounts":
        return SpecCounts(self.num_steps, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                          list(self.num_accepted_tokens_per_pos))

    def since(self, earlier: "SpecCounts") -> "SpecCounts":
        """The counts added after `earlier` (a copy taken before)."""
        per_pos = [n - (earlier.num_accepted_tokens_per_pos[i] if i < len(earlier.num_accepted_tokens_per_pos) else 0)
                   for i, n in enumerate(self.num_accepted_tokens_per_pos)]
        return SpecCounts(self.num_steps - earlier.num_steps, self.num_drafts - earlier.num_drafts,
                          self.num_draft_tokens - earlier.num_draft_tokens,
                          self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    @property
    def mean_acceptance_length(self) -> float | None:
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)

    @property
    def tokens_per_step(self) -> float | None:
        return tokens_per_step(self.num_accepted_tokens, self.num_steps)

    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    def per_position_acceptance_rate(self) -> list[float]:
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos] if self.num_drafts else []

    def to_dict(self) -> dict:
        """vLLM's per-request `speculative_decoding` metrics plus ours."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "mean_acceptance_length": _rounded(self.mean_acceptance_length),
                "num_steps": self.num_steps, "tokens_per_step": _rounded(self.tokens_per_step)}


def mean_acceptance_length(accepted: float, drafts: float) -> float | None:
    """1 + accepted / drafts: tokens per drafting step, bonus included (vLLM's definition)."""
    return 1 + accepted / drafts if drafts else None


def tokens_per_step(accepted: float, steps: float) -> float | None:
    """(steps + accepted) / steps: tokens per verify step, k = 0 steps included (None without steps)."""
    return (steps + accepted) / steps if steps else None


def acceptance_rate(accepted: float, draft_tokens: float) -> float | None:
    """accepted / draft tokens: the fraction of drafted tokens the target accepted."""
    return accepted / draft_tokens if draft_tokens else None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
