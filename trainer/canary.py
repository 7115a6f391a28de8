"""Watches the acceptance a newly published drafter gets on live traffic; says when to roll back.

The live signal is the per-token acceptance rate accepted / drafted over the steps the head
drafted, read from the event records (which name the drafter version that produced them, and the
proposer of each step: the suffix index's drafts do not count). After a swap,
once the new version has `window` drafted tokens, it is compared with the previous version's rate
over its last `window` tokens; falling more than `margin` below means roll back.
"""

from __future__ import annotations

from collections import defaultdict, deque

from specrl.spec.quantities import acceptance_rate
from specrl.telemetry.record import SegmentRecord


class Canary:
    def __init__(self, window: int, margin: float):
        self.window, self.margin = window, margin
        self._steps: dict[str, deque[tuple[int, int]]] = defaultdict(deque)  # version -> (k, accepted)
        self.watching: tuple[str, str] | None = None  # (new version, previous version)

    def observe(self, record: SegmentRecord) -> None:
        steps = self._steps[record.drafter_version]
        for step in record.steps:
            if step.k > 0 and step.proposer != "suffix":
                steps.append((step.k, step.accepted))
        while sum(k for k, _ in steps) > 4 * self.window:
            steps.popleft()

    def rate(self, version: str) -> tuple[float | None, int]:
        """-> (accepted / drafted over the last `window` drafted tokens, drafted tokens seen)."""
        drafted = accepted = 0
        for k, a in reversed(self._steps.get(version, ())):
            if drafted >= self.window:
                break
            drafted, accepted = drafted + k, accepted + a
        return acceptance_rate(accepted, drafted), drafted

    def watch(self, new: str, previous: str) -> None:
        self.watching = (new, previous)
        self._steps.pop(new, None)

    def verdict(self) -> str | None:
        """-> a reason to roll back, or None (keep, or not enough evidence yet)."""
        if self.watching is None:
            return None
        new, previous = self.watching
        new_rate, seen = self.rate(new)
        old_rate, _ = self.rate(previous)
        if seen < self.window or new_rate is None or old_rate is None:
            return None
        self.watching = None
        if new_rate < old_rate - self.margin:
            return f"drafter {new} accepts {new_rate:.3f} of drafted tokens live vs {old_rate:.3f} for {previous}"
        return None
