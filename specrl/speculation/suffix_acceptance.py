"""How often the suffix index's drafted tokens are accepted, learned live.

A suffix draft's token j (0-based) is accepted, given that the tokens before it were, with
probability

    p_j = min(1, q[cell_j] * c_j),    cell_j = (own, sampled, bucket of match_length + j)

where c_j is the token's vote share (`SuffixDraft.confidences`) and match_length + j is how many
context tokens the voting occurrences match once the j tokens before it are accepted. Why cells
and not one scale: measured offline by exact greedy simulation of suffix drafts (k <= 16) on
SmolLM2's answers to 32 held-out prompts, the index holding 256 other answers of the same prompt
mix (2,668 drafted tokens), acceptance rose from 0.43 at an effective match of 2 tokens to 0.52
at 4-5, 0.70 at 6-9 and 0.97 beyond 17, and was 0.82 for drafts from the request's own text
against 0.39 from other requests'. One scale over all confidences (the model before this one)
predicted the other half of those tokens with a log loss of 0.56 a token, these cells 0.47, and
live it fell to 0.09 on a run of first tokens rejected, rating a 16-token repeat of the request's
own text at 1.4 tokens: the planner stopped drafting where the index was right.

A sampled draft (drawn from the votes for a row that samples: suffix_index.py) has cells of its
own: its token d is accepted with probability min(1, p(d) / v(d)), not p(d) as a most-voted
token of a sampled row is, nor [d = argmax p] as a greedy row's.

Estimate: q[cell] = (accepted + w * q0) / (tried + w) over the tokens tried in the cell (a token
is tried when every token before it was accepted: the tokens after a draft's first rejection say
nothing about themselves), `accepted` counting them and `tried` summing their vote shares, both
decayed by `decay` per token observed in the cell; shrunk towards the pooled estimate q0 over all
cells (decayed by `pooled_decay`) with the weight of `shrink` tokens, so that a cell seen rarely
borrows from the others. q0 starts at `initial` with the weight of one token.

Expected accepted tokens of a draft cut to n tokens: sum_{i < n} prod_{j <= i} p_j (`gains`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from specrl.speculation.suffix_index import SuffixDraft

MATCH_BUCKETS = (2, 3, 5, 9, 17)  # upper bounds of the effective match length per cell; longer: one more cell


def match_bucket(length: int) -> int:
    """The cell index of an effective match length: the first bucket whose bound is >= length."""
    return bisect.bisect_left(MATCH_BUCKETS, length)


@dataclass
class SuffixAcceptance:
    initial: float = 0.5
    decay: float = 0.97
    pooled_decay: float = 0.99
    shrink: float = 4.0
    _cells: dict[tuple[bool, bool, int], list[float]] = field(default_factory=dict)  # cell -> [accepted, tried]
    _pooled: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pooled = [self.initial, 1.0]

    @property
    def pooled(self) -> float:
        """q0: accepted tokens per unit of vote share, over every cell."""
        return self._pooled[0] / self._pooled[1]

    def scale(self, own: bool, effective_match: int, sampled: bool = False) -> float:
        """q of the cell of a token drafted from `own` text with this effective match length, drawn
        from the votes (`sampled`) or the most voted."""
        accepted, tried = self._cells.get((own, sampled, match_bucket(effective_match)), (0.0, 0.0))
        if tried + self.shrink <= 0:  # an empty cell without shrinkage
            return self.pooled
        return (accepted + self.shrink * self.pooled) / (tried + self.shrink)

    def probabilities(self, draft: SuffixDraft | None) -> list[float]:
        """p_j for each of the draft's tokens (conditional on the tokens before it being accepted)."""
        if draft is None:
            return []
        return [min(1.0, self.scale(draft.own, draft.match_length + j, draft.sampled) * c)
                for j, c in enumerate(draft.confidences)]

    def gains(self, draft: SuffixDraft | None, limit: int) -> list[float]:
        """gains[n]: expected accepted tokens of the draft cut to n <= limit tokens (gains[0] = 0)."""
        out, reach = [0.0], 1.0
        for p in self.probabilities(draft)[:limit]:
            reach *= p
            out.append(out[-1] + reach)
        return out

    def observe(self, draft: SuffixDraft, drafted: int, accepted: int) -> None:
        """The first `drafted` tokens of `draft` were verified and `accepted` of them accepted."""
        for j in range(min(drafted, accepted + 1)):  # the tried tokens: the accepted ones and the first rejected
            ok, share = float(j < accepted), draft.confidences[j]
            cell = self._cells.setdefault((draft.own, draft.sampled, match_bucket(draft.match_length + j)), [0.0, 0.0])
            cell[0], cell[1] = self.decay * cell[0] + ok, self.decay * cell[1] + share
            self._pooled[0] = self.pooled_decay * self._pooled[0] + ok
            self._pooled[1] = self.pooled_decay * self._pooled[1] + share
