"""The canary (trainer/canary.py) judges a new drafter by the head's own drafts only."""

from specrl.telemetry.record import SegmentRecord, StepRecord
from specrl.trainer.canary import Canary


def record(version: str, accepted: int, k: int = 4, proposer: str = "head", steps: int = 10) -> SegmentRecord:
    return SegmentRecord("r", 0, "base", version, steps=[StepRecord(0, k, [1] * k, [0.0] * k, accepted, 2, proposer)
                                                        for _ in range(steps)])


def test_a_drafter_accepting_worse_live_is_rolled_back():
    canary = Canary(window=20, margin=0.05)
    canary.observe(record("v1", 3))
    canary.watch("v2", "v1")
    canary.observe(record("v2", 1))
    assert "v2 accepts 0.250" in canary.verdict()


def test_the_suffix_index_drafts_do_not_count():
    canary = Canary(window=20, margin=0.05)
    canary.observe(record("v1", 2))  # the head: 0.5
    canary.observe(record("v1", 4, proposer="suffix"))  # the index, with the same drafter serving: 1.0
    canary.watch("v2", "v1")
    canary.observe(record("v2", 2))
    assert canary.rate("v1") == (0.5, 20) and canary.verdict() is None  # not judged against the index's 1.0
