"""Training on the features the records ship vs recomputing them; the book's feature assembly; the
train queue's rule. No Redis: records come from a real engine into a memory sink."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from specrl.config import Settings
from specrl.engine.engine import Engine
from specrl.speculation.sampling import SamplingParams
from specrl.telemetry.record import SegmentRecord
from specrl.telemetry.sink import MemorySink
from specrl.trainer.contexts import ContextBook, Example
from specrl.trainer.drafter_trainer import DrafterTrainer
from specrl.trainer.throughput import Queued, TrainQueue
from specrl.weights import WeightsStore
from tests.engine.conftest import chat_prompts


@pytest.fixture(scope="module")
def records(home, tiny_dir, tokenizer):
    """Segment records with features: 4 chat prompts (sharing the template: the prefix cache serves
    the later ones' first positions), 100 tokens each (two segments), fp32 tiny target."""
    settings = Settings.load(home=home, model="tiny-random", dtype="float32", max_batch=4, fixed_draft_tokens=3)
    sink = MemorySink(features_max_bytes=1 << 22)
    engine = Engine.from_settings(settings, sink=sink, progress=False)
    engine.generate(chat_prompts(tokenizer, 4), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    return list(sink.records)


def make_trainer(home, tmp_path, tiny_dir, **overrides) -> DrafterTrainer:
    settings = Settings.load(home=home, model="tiny-random", store=str(tmp_path / "store"), lr=3e-3,
                             **{"trainer_replay_records": 0, **overrides})
    return DrafterTrainer(settings, tiny_dir, None, store=WeightsStore(settings.store_path), publisher=None,
                          state_path=tmp_path / "state.pt")


def without_features(record: SegmentRecord) -> SegmentRecord:
    return dataclasses.replace(record, features=None, feature_start=0, feature_dim=0, feature_dtype="")


def test_training_on_shipped_features_equals_training_on_recomputed_ones(home, tmp_path, tiny_dir, records):
    shipped = make_trainer(home, tmp_path / "a", tiny_dir, trainer_recompute=False)  # the target's head only
    recomputed = make_trainer(home, tmp_path / "b", tiny_dir)
    assert torch.equal(shipped.drafter.fc, recomputed.drafter.fc)  # the same day-0 drafter
    a = [e for e in map(shipped.book.add, records) if e is not None]
    b = [e for e in map(recomputed.book.add, map(without_features, records)) if e is not None]
    assert any(r.segment == 0 and r.feature_start > 0 for r in records)  # prefix-cache gaps ...
    assert not all(e.complete for e in a)  # one arrived before the context that computed its first positions ...
    assert all(e.complete or shipped.book.fill(e) for e in a)  # ... which completes it once read
    assert all(e.features is None for e in b)
    losses = []
    for step in range(3):
        batch = slice(2 * step, 2 * step + 2)
        losses.append((shipped.train(a[batch]), recomputed.train(b[batch])))
    for x, y in losses:
        # float16 features: the same loss within its rounding (measured 4e-6, 9e-5, 9e-4 over the three
        # steps as the trajectories drift); a feature off by one position changes it by far more
        assert x == pytest.approx(y, rel=5e-3), losses
    assert losses[0][0] != losses[-1][0]  # it learned: not the same number three times
    for p, q in zip(shipped.drafter.parameters(), recomputed.drafter.parameters()):
        # AdamW steps are about lr wherever a gradient is nonzero, so rounding can move a weight
        # by ~lr either way: compare whole tensors, not elements
        assert (p - q).norm() <= 1e-2 * p.norm()  # measured: at most 5e-4
    assert shipped.targets.loaded_full == [] and shipped.tokens["trainer_recomputed"] == 0
    assert shipped.features.shipped == 6 and shipped.features.recomputed == 0
    assert recomputed.targets.loaded_full == ["base"] and recomputed.tokens["trainer_recomputed"] > 0
    assert shipped.tokens["trained"] == recomputed.tokens["trained"] > 0


def test_an_example_without_features_and_no_target_is_not_trained(home, tmp_path, tiny_dir, records):
    trainer = make_trainer(home, tmp_path, tiny_dir, trainer_recompute=False)
    [example] = [e for e in map(trainer.book.add, map(without_features, records[:1])) if e is not None]
    assert trainer.train([example]) != trainer.train([example])  # nan: nothing to train on
    assert trainer.step == 0 and trainer.tokens["unusable"] == 2 * len(example.positions)


def test_features_that_do_not_fit_their_context_are_refused(records):
    first = next(r for r in records if r.segment == 0 and r.feature_start == 0)
    book = ContextBook(hidden_size=first.feature_dim, features_max_bytes=1 << 22)
    short = copy.deepcopy(first)
    short.features = short.features[: -2 * short.feature_dim]  # one row missing
    with pytest.raises(ValueError, match="do not fit a context"):
        book.add(short)
    with pytest.raises(ValueError, match="hidden size 32"):
        ContextBook(hidden_size=32).add(first)
    with pytest.raises(ValueError, match="budget"):
        ContextBook(hidden_size=first.feature_dim, features_max_bytes=100).add(first)
    bad = copy.deepcopy(first)
    bad.set_features(0, torch.full((first.feature_rows, first.feature_dim), float("inf")))
    with pytest.raises(ValueError, match="finite"):
        book.add(bad)
    assert book.add(first).complete  # nothing of the refused ones was kept: the good one is new


def test_a_later_segment_continues_the_features_of_its_request(records):
    book = ContextBook()
    by_request = {}
    for r in records:
        by_request.setdefault(r.request_id, []).append(r)
    rid, segments = next((k, v) for k, v in by_request.items() if len(v) >= 2 and v[0].feature_start == 0)
    first, second = book.add(segments[0]), book.add(segments[1])
    assert first.complete and second.complete and second.feature_start == 0
    assert torch.equal(second.features[: len(first.features)], first.features)
    assert len(second.features) == len(second.tokens) - 1
    assert ContextBook().add(segments[1]) is None  # without its segment 0: an orphan


def queued(ms: int, name: str = "") -> Queued:
    return Queued(ms, f"{ms}-0", Example(name or f"r{ms}", 0, "base", "day0", [1, 2, 3, 4], 0, 2))


def test_the_queue_trains_the_freshest_first_and_expires_the_old():
    queue = TrainQueue(capacity=4, max_age_s=10, replay_capacity=3)
    for ms in (1000, 3000, 2000, 4000):
        assert queue.push(queued(ms)) == []
    assert [q.arrived_ms for q in queue.push(queued(5000))] == [1000]  # full: the oldest is pushed out
    assert [q.arrived_ms for q in queue.take(2)] == [5000, 4000]  # freshest first
    assert [q.arrived_ms for q in queue.expire(now_ms=12_500)] == [2000]  # older than 10 s
    assert [q.arrived_ms for q in queue.take(5, ready=lambda q: q.arrived_ms != 3000)] == []  # not ready: it stays
    assert len(queue) == 1
    queue.trained([queued(ms).example for ms in range(5)])
    assert len(queue.replay) == 3 and len(queue.replay_batch(2)) == 2 and len(queue.replay_batch(10)) == 3
    assert TrainQueue(4, 10, 0).replay_batch(4) == []  # replay off
