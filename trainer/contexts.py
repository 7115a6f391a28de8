"""Rebuild training contexts from segment records.

A request's records arrive as segments 0, 1, 2, ...: segment 0 carries the prompt, every
segment the tokens it committed. The book keeps each request's tokens so far (bounded, least
recently used dropped first) and turns each new segment into one example: the whole context up
to the segment's end, and the drafter positions whose prediction is trained on.

Drafter position j reads (target feature at j, token at j+1) and predicts the token at j+2.
Every position the target computed is signal, prompt positions included (segment 0).

Features: a record may carry the target's hidden states of the positions the server computed for
it (schema 4: its segment's positions through the next-to-last context token). The book keeps
each context's features from position 0 (float16, at most FEATURE_BYTES, least recently used
dropped first) and completes a record's with what comes before them: the request's earlier
segments, or, for positions the server's prefix cache served, any remembered context of the same
target version that starts with the same tokens (the hidden state at j depends on tokens 0..j
only). An example whose features cannot be completed yet keeps them with `feature_start` > 0:
`fill` tries again later, or the trainer recomputes the rest. Features are not in `state()`: after
a restart, contexts continue without them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specrl.telemetry.record import SegmentRecord

FEATURE_BYTES = 256 << 20  # remembered features (SmolLM2: ~230k tokens)


@dataclass
class Example:
    request_id: str
    segment: int
    target_version: str
    drafter_version: str
    tokens: list[int]  # the context: prompt + committed tokens through this segment
    first: int  # drafter positions first..len(tokens)-3 are trained
    start: int  # position of this segment's first committed token
    rejected: list[tuple[int, int]] = field(default_factory=list)  # (drafter position, rejected draft token)
    steps: list[tuple[int, list[int], int]] = field(default_factory=list)  # (position, draft tokens, accepted)
    # [n, H] float16: the target's hidden states at positions feature_start .. len(tokens) - 2
    # (None: the records carried none); complete when feature_start == 0.
    features: torch.Tensor | None = field(default=None, repr=False)
    feature_start: int = 0

    @property
    def positions(self) -> range:
        return range(self.first, max(self.first, len(self.tokens) - 2))

    @property
    def complete(self) -> bool:
        """Features for every position the drafter reads (0 .. len(tokens) - 2)."""
        return self.features is not None and self.feature_start == 0


class ContextBook:
    def __init__(self, max_requests: int = 10_000, max_seen: int = 200_000, *, hidden_size: int | None = None,
                 features_max_bytes: int | None = None, feature_bytes: int = FEATURE_BYTES):
        """hidden_size, features_max_bytes: what a record's features must fit (None: not checked)."""
        self.max_requests, self.max_seen = max_requests, max_seen
        self.hidden_size, self.features_max_bytes, self.feature_bytes = hidden_size, features_max_bytes, feature_bytes
        self._tokens: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()  # id -> (next segment, tokens)
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()  # dedupe keys, oldest dropped first
        # id -> (target version, tokens, features [len(tokens) - 1, H] float16 from position 0)
        self._features: OrderedDict[str, tuple[str, list[int], torch.Tensor]] = OrderedDict()
        self._features_held = 0  # bytes in _features
        self.orphans = 0  # segments whose earlier segments never arrived

    def seen(self, key: tuple[str, int]) -> bool:
        return key in self._seen

    def _mark(self, key: tuple[str, int]) -> None:
        self._seen[key] = None
        while len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)

    def add(self, record: SegmentRecord) -> Example | None:
        """-> an example, or None for a duplicate or an orphan segment (counted). ValueError for a
        record that cannot be used (no prompt in segment 0; features that do not fit: dtype, hidden
        size, budget, positions, values): nothing of it is kept."""
        key = (record.request_id, record.segment)
        if key in self._seen:
            return None
        problem = record.feature_problem(self.hidden_size, self.features_max_bytes)
        if problem is not None:
            raise ValueError(f"features: {problem}")
        if record.segment == 0:
            if record.prompt_ids is None:
                raise ValueError("segment 0 has no prompt_ids")
            tokens = list(record.prompt_ids)
        else:
            expected, tokens = self._tokens.get(record.request_id, (None, None))
            if expected != record.segment:
                self.orphans += 1
                self._mark(key)
                return None
        start = len(tokens)
        tokens = tokens + list(record.tokens)
        rows = self._check_rows(record, start, len(tokens))
        self._mark(key)
        if record.finish_reason is None:
            self._tokens[record.request_id] = (record.segment + 1, tokens)
            self._tokens.move_to_end(record.request_id)
            while len(self._tokens) > self.max_requests:
                self._tokens.popitem(last=False)
        else:
            self._tokens.pop(record.request_id, None)
        rejected, steps = [], []
        for step in record.steps:
            if step.proposer == "suffix":  # the index's drafts say nothing about the head's distribution
                continue
            steps.append((step.position, list(step.draft_tokens), step.accepted))
            if step.accepted < step.k:  # draft i (0-based) sits at position step.position + i
                position = step.position + step.accepted
                rejected.append((position - 2, step.draft_tokens[step.accepted]))
        first = 0 if record.segment == 0 else max(start - 2, 0)
        example = Example(record.request_id, record.segment, record.target_version, record.drafter_version, tokens,
                          first, start, [r for r in rejected if r[0] >= 0], steps, rows, record.feature_start)
        self.fill(example)
        return example

    @staticmethod
    def _check_rows(record: SegmentRecord, start: int, length: int) -> torch.Tensor | None:
        """The record's features [n, H] float16, checked against its context: they must end at the
        next-to-last context position and begin no later than the segment's first pending token."""
        rows = record.feature_tensor()
        if rows is None:
            return None
        end = record.feature_start + len(rows)
        if end != length - 1 or record.feature_start > start - 1:
            raise ValueError(f"features: {len(rows)} rows from position {record.feature_start} do not fit a context "
                             f"of {length} tokens whose segment starts at {start} (they must end at {length - 2} "
                             f"and start by {start - 1})")
        if not torch.isfinite(rows).all():
            raise ValueError("features: not all finite (float16 overflow?)")
        return rows

    # ---- features --------------------------------------------------------------------------------
    def fill(self, example: Example) -> bool:
        """Complete the example's features from position 0 if the book has what comes before them
        (then it remembers the context). -> whether they are complete."""
        if example.features is None:
            return False
        if example.feature_start > 0:
            prior = self._prefix(example.request_id, example.target_version, example.tokens, example.feature_start)
            if prior is None:
                return False
            example.features, example.feature_start = torch.cat([prior, example.features]), 0
        self.remember(example.request_id, example.target_version, example.tokens, example.features)
        return True

    def remember(self, request_id: str, version: str, tokens: list[int], features: torch.Tensor) -> None:
        """features [len(tokens) - 1, H] float16 from position 0: for the request's next segments and
        for contexts that share its prefix."""
        old = self._features.pop(request_id, None)
        if old is not None:
            self._features_held -= old[2].nbytes
        self._features[request_id] = (version, tokens, features)
        self._features_held += features.nbytes
        while self._features_held > self.feature_bytes and self._features:
            self._features_held -= self._features.popitem(last=False)[1][2].nbytes

    def _prefix(self, request_id: str, version: str, tokens: list[int], n: int) -> torch.Tensor | None:
        """Features [n, H] of positions 0..n-1 of `tokens` at `version`: the request's own, else the
        most recent context that starts with the same n tokens; None if the book has neither."""
        own = self._features.get(request_id)
        for entry in ([own] if own is not None else []) + list(reversed(self._features.values())):
            seen_version, seen_tokens, rows = entry
            if seen_version == version and len(rows) >= n and seen_tokens[:n] == tokens[:n]:
                return rows[:n]
        return None

    def state(self) -> dict:
        return {"tokens": list(self._tokens.items()), "seen": list(self._seen), "orphans": self.orphans}

    def load_state(self, state: dict) -> None:
        self._tokens = OrderedDict((k, (v[0], list(v[1]))) for k, v in state["tokens"])
        self._seen = OrderedDict((tuple(x), None) for x in state["seen"])
        self.orphans = state["orphans"]
