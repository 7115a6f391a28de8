"""The canary (trainer/canary.py) judges newly published drafters by the head's own drafts only,
the versions published since its last verdict together."""

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
    rollback = canary.verdict()
    assert "v2 accepts 0.250" in rollback.reason and rollback.to == "v1"


def test_the_suffix_index_drafts_do_not_count():
    canary = Canary(window=20, margin=0.05)
    canary.observe(record("v1", 2))  # the head: 0.5
    canary.observe(record("v1", 4, proposer="suffix"))  # the index, with the same drafter serving: 1.0
    canary.watch("v2", "v1")
    canary.observe(record("v2", 2))
    assert canary.rate("v1") == (0.5, 20) and canary.verdict() is None  # not judged against the index's 1.0


def test_versions_published_faster_than_evidence_are_judged_together_against_the_last_good():
    canary = Canary(window=20, margin=0.05)
    canary.observe(record("v1", 3))
    canary.watch("v2", "v1")
    canary.observe(record("v2", 1, steps=2))  # 8 drafted tokens: not enough to judge v2 alone
    assert canary.verdict() is None
    canary.watch("v3", "v2")
    canary.observe(record("v3", 1, steps=3))  # v2 + v3: 20 drafted tokens at 0.25
    rollback = canary.verdict()
    assert rollback.to == "v1" and "v3 accepts 0.250" in rollback.reason and "v2, v3" in rollback.reason
    assert canary.verdict() is None  # judged once


def test_a_chain_judged_good_is_the_next_baseline():
    canary = Canary(window=20, margin=0.05)
    canary.observe(record("v1", 2))  # 0.5
    canary.watch("v2", "v1")
    canary.observe(record("v2", 3, steps=3))
    canary.watch("v3", "v2")
    canary.observe(record("v3", 3, steps=3))  # v2 + v3 at 0.75: good
    assert canary.verdict() is None and canary.chain == []
    canary.watch("v4", "v3")
    assert canary.baseline == ["v2", "v3"]  # judged on the chain's 24 tokens, not on v3's 12 alone
    canary.observe(record("v4", 2, steps=5))  # 0.5: below the baseline's 0.75
    assert canary.verdict().to == "v3"
