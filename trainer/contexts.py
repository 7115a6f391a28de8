"""Rebuild training contexts from segment records.

A request's records arrive as segments 0, 1, 2, ...: segment 0 carries the prompt, every
segment the tokens it committed. The book keeps each request's tokens so far (bounded, least
recently used dropped first) and turns each new segment into one example: the whole context up
to the segment's end, and the drafter positions whose prediction is trained on.

Drafter position j reads (target feature at j, token at j+1) and predicts the token at j+2.
Every position the target computed is signal, prompt positions included (segment 0).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specrl.telemetry.record import SegmentRecord


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

    @property
    def positions(self) -> range:
        return range(self.first, max(self.first, len(self.tokens) - 2))


class ContextBook:
    def __init__(self, max_requests: int = 10_000, max_seen: int = 200_000):
        self.max_requests, self.max_seen = max_requests, max_seen
        self._tokens: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()  # id -> (next segment, tokens)
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()  # dedupe keys, oldest dropped first
        self.orphans = 0  # segments whose earlier segments never arrived

    def seen(self, key: tuple[str, int]) -> bool:
        return key in self._seen

    def _mark(self, key: tuple[str, int]) -> None:
        self._seen[key] = None
        while len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)

    def add(self, record: SegmentRecord) -> Example | None:
        """-> an example, or None for a duplicate or an orphan segment (counted)."""
        key = (record.request_id, record.segment)
        if key in self._seen:
            return None
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
        return Example(record.request_id, record.segment, record.target_version, record.drafter_version, tokens,
                       first, start, [r for r in rejected if r[0] >= 0], steps)

    def state(self) -> dict:
        return {"tokens": list(self._tokens.items()), "seen": list(self._seen), "orphans": self.orphans}

    def load_state(self, state: dict) -> None:
        self._tokens = OrderedDict((k, (v[0], list(v[1]))) for k, v in state["tokens"])
        self._seen = OrderedDict((tuple(x), None) for x in state["seen"])
        self.orphans = state["orphans"]
