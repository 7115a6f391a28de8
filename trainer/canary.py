"""Watches the acceptance newly published drafters get on live traffic; says when to roll back.

The live signal is the per-token acceptance rate accepted / drafted over the steps the head
drafted, read from the event records (which name the drafter version that produced them, and the
proposer of each step: the suffix index's drafts do not count).

Publishes come faster than live evidence does (a publish every few seconds, against `window`
drafted tokens needed to judge one), so the versions published since the last verdict are judged
together as one chain: once the chain has `window` drafted tokens, its rate over its last
`window` tokens is compared with the baseline's (the versions judged good last, or the one serving
before the chain). Falling more than `margin` below means roll back to the baseline's newest
version, the last one known good.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from specrl.speculation.quantities import acceptance_rate
from specrl.telemetry.record import SegmentRecord


@dataclass(frozen=True)
class Rollback:
    reason: str
    to: str  # the version to serve again: the newest of the baseline


class Canary:
    def __init__(self, window: int, margin: float):
        self.window, self.margin = window, margin
        self._steps: dict[str, deque[tuple[int, int]]] = defaultdict(deque)  # version -> (k, accepted)
        self.chain: list[str] = []  # versions published since the last verdict, oldest first
        self.baseline: list[str] = []  # what the chain is judged against, oldest first
        self._judged: list[str] = []  # the last chain judged good

    def observe(self, record: SegmentRecord) -> None:
        steps = self._steps[record.drafter_version]
        for step in record.steps:
            if step.k > 0 and step.proposer != "suffix":
                steps.append((step.k, step.accepted))
        while sum(k for k, _ in steps) > 4 * self.window:
            steps.popleft()

    def rate(self, *versions: str) -> tuple[float | None, int]:
        """-> (accepted / drafted over the last `window` drafted tokens of `versions`, given oldest
        first, drafted tokens counted)."""
        drafted = accepted = 0
        for version in reversed(versions):
            for k, a in reversed(self._steps.get(version, ())):
                if drafted >= self.window:
                    return acceptance_rate(accepted, drafted), drafted
                drafted, accepted = drafted + k, accepted + a
        return acceptance_rate(accepted, drafted), drafted

    def watch(self, new: str, previous: str) -> None:
        """`new` now serves in place of `previous`."""
        if not self.chain:
            self.baseline = self._judged if self._judged[-1:] == [previous] else [previous]
        self.chain.append(new)
        self._steps.pop(new, None)

    def verdict(self) -> Rollback | None:
        """-> a rollback, or None (keep, or not enough evidence yet)."""
        if not self.chain:
            return None
        new_rate, seen = self.rate(*self.chain)
        old_rate, _ = self.rate(*self.baseline)
        if seen < self.window or new_rate is None or old_rate is None:
            return None
        chain, baseline = self.chain, self.baseline
        self.chain = []
        if new_rate >= old_rate - self.margin:
            self._judged = chain
            return None
        since = f" (published since {baseline[-1]}: {', '.join(chain)})" if len(chain) > 1 else ""
        return Rollback(f"drafter {chain[-1]} accepts {new_rate:.3f} of drafted tokens live vs {old_rate:.3f} for "
                        f"{baseline[-1]}{since}", baseline[-1])
