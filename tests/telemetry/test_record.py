"""The event record's features (schema 4), older schemas, the segment writer's feature rows, the
sinks' token counts and the token-use ledger. No Redis."""

from __future__ import annotations

import msgpack
import pytest
import torch

from specrl.telemetry.record import FEATURE_DTYPE, SCHEMA_VERSION, SegmentRecord, StepRecord
from specrl.telemetry.redis_sink import strip_content
from specrl.telemetry.segments import SegmentWriter
from specrl.telemetry.sink import MemorySink
from specrl.telemetry.token_use import COMPUTED, token_yield


def step(position: int, k: int = 0, accepted: int = 0) -> StepRecord:
    return StepRecord(position, k, [5] * k, [-0.5] * k, accepted, 7, "head" if k else "")


def test_features_round_trip_as_float16_with_their_positions():
    rows = torch.randn(6, 8) * 100
    record = SegmentRecord("r", 0, "base", "day0", prompt_ids=[1, 2, 3, 4, 5], tokens=[6, 7])
    record.set_features(0, rows)
    back = SegmentRecord.from_msgpack(record.to_msgpack())
    assert back.schema == SCHEMA_VERSION == 4 and back.feature_dtype == FEATURE_DTYPE
    assert (back.feature_start, back.feature_dim, back.feature_rows) == (0, 8, 6)
    assert len(back.features) == 6 * 8 * 2  # 2 bytes per value: 2 * H per token
    assert torch.equal(back.feature_tensor(), rows.half())
    assert back.feature_problem(8, 1 << 20) is None


def test_schema_3_records_are_still_read_without_features():
    raw = {"request_id": "r", "segment": 0, "target_version": "base", "drafter_version": "day0", "deployment": "d",
           "replica": "0", "prompt_ids": [1, 2], "tokens": [3], "finish_reason": "stop", "schema": 3,
           "steps": [{"position": 2, "k": 1, "draft_tokens": [3], "draft_logprobs": [-0.1], "accepted": 1,
                      "target_token": 4, "proposer": "suffix"}]}
    record = SegmentRecord.from_msgpack(msgpack.packb(raw, use_bin_type=True))
    assert record.features is None and record.feature_rows == 0 and record.feature_tensor() is None
    assert record.steps[0].proposer == "suffix" and record.schema == SCHEMA_VERSION


def test_feature_problems_name_what_does_not_fit():
    record = SegmentRecord("r", 0, "base", "day0", prompt_ids=[1, 2, 3], tokens=[4])
    record.set_features(0, torch.ones(3, 8))
    assert "hidden size 16" in record.feature_problem(16, None)
    assert "budget of 10" in record.feature_problem(8, 10) and "record_features_max_bytes" in record.feature_problem(8, 10)
    record.feature_dtype = "bfloat16"
    assert "bfloat16" in record.feature_problem(8, None)
    record.feature_dtype, record.features = FEATURE_DTYPE, record.features[:-2]
    assert "whole rows" in record.feature_problem(8, None)


def test_content_off_strips_the_features():
    record = SegmentRecord("r", 0, "base", "day0", prompt_ids=[1, 2, 3], tokens=[4])
    record.set_features(0, torch.ones(3, 8))
    stripped = strip_content(record)
    assert stripped.features is None and (stripped.feature_start, stripped.feature_dim, stripped.feature_dtype) == (0, 0, "")
    assert record.features is not None  # the original is untouched


def test_writer_ships_consecutive_rows_of_the_prefill_and_every_step():
    sink = MemorySink(features_max_bytes=1 << 20)
    writer = SegmentWriter(sink, "r", [1, 2, 3, 4], deployment="d", replica="0")
    hidden = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    writer.add_features(1, hidden[1:4])  # prefill of positions 1..3 (the prefix cache gave position 0)
    writer.add(step(4), [9], "base", "day0", features=hidden[3:3])  # the first token: no new position
    writer.add(step(5, k=2, accepted=1), [5, 7], "base", "day0", features=hidden[4:6])  # verified 4 and 5
    writer.add(step(7, k=1), [7], "base", "day0", features=hidden[6:7])
    writer.close("stop")
    [record] = sink.records
    assert record.feature_start == 1 and record.feature_rows == 6  # positions 1..6: up to the next-to-last token
    assert len(record.prompt_ids) + len(record.tokens) - 2 == record.feature_start + record.feature_rows - 1
    assert torch.equal(record.feature_tensor().float(), hidden[1:7])


def test_writer_ships_no_features_over_the_budget_after_a_gap_or_when_the_sink_takes_none():
    hidden = torch.ones(100, 4)
    small = MemorySink(features_max_bytes=8 * 4 * 2)  # 8 rows of 4 float16 values
    writer = SegmentWriter(small, "r", [1] * 10, deployment="d", replica="0")
    writer.add_features(0, hidden[:10])
    writer.add(step(10), [1], "base", "day0")
    writer.close("stop")
    assert small.records[0].features is None
    gap = MemorySink(features_max_bytes=1 << 20)
    writer = SegmentWriter(gap, "r", [1] * 4, deployment="d", replica="0")
    writer.add_features(0, hidden[:2])
    writer.add(step(5), [1], "base", "day0", features=hidden[:1])  # position 4: positions 2, 3 are missing
    writer.close("stop")
    assert gap.records[0].features is None
    none = MemorySink()  # features_max_bytes 0: the default, and what content-off and vLLM sinks say
    writer = SegmentWriter(none, "r", [1] * 4, deployment="d", replica="0")
    writer.add_features(0, hidden[:4])
    writer.add(step(4), [1], "base", "day0")
    writer.close("stop")
    assert none.records[0].features is None


def test_a_full_segment_keeps_its_own_rows_and_the_next_starts_at_its_pending_token():
    from specrl.telemetry.record import SEGMENT_STEPS

    sink = MemorySink(features_max_bytes=1 << 20)
    writer = SegmentWriter(sink, "r", [1, 2], deployment="d", replica="0")
    hidden = torch.randn(SEGMENT_STEPS + 10, 4)
    writer.add_features(0, hidden[:2])
    writer.add(step(2), [3], "base", "day0")
    for i in range(SEGMENT_STEPS + 2):  # k = 0 steps: one new position each
        writer.add(step(3 + i), [3], "base", "day0", features=hidden[2 + i: 3 + i])
    writer.close("stop")
    first, second = sink.records
    assert (first.feature_start, first.feature_rows) == (0, 2 + SEGMENT_STEPS - 1)
    assert second.feature_start == first.feature_start + first.feature_rows
    assert len(first.prompt_ids) + len(first.tokens) - 1 == first.feature_rows


def test_memory_sink_counts_the_tokens_it_evicts():
    sink = MemorySink(capacity=2)
    for i in range(3):
        sink.emit(SegmentRecord(f"r{i}", 0, "base", "day0", prompt_ids=[1, 2, 3], tokens=[4] * i))
    assert sink.dropped == 1 and sink.dropped_tokens == 3  # r0: its prompt, no tokens


def test_token_yield_is_useful_over_computed():
    from specrl.engine.outputs import EngineStats
    from specrl.telemetry.token_use import server_uses

    stats = EngineStats(generated_tokens=30, prompt_tokens_computed=100, prompt_tokens_repeated=40,
                        kv_recomputed_tokens=10)
    stats.spec.count(4, 1)  # 3 rejected draft positions
    uses = {**server_uses(stats, MemorySink()), "trained": 45, "trainer_recomputed": 90}
    assert uses["prompt"] == 60 and uses["draft_rejected"] == 3 and uses["telemetry_dropped"] == 0
    y = token_yield(uses)
    assert y["computed"] == 60 + 40 + 10 + 30 + 3 + 90 == sum(uses[u] for u in COMPUTED)
    assert y["useful"] == 90 and y["yield"] == pytest.approx(90 / 233) and y["trained_share"] == 0.5
    assert token_yield({})["yield"] is None
