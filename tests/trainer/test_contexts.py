import pytest

from specrl.telemetry.record import SegmentRecord, StepRecord
from specrl.trainer.contexts import ContextBook


def seg(segment, tokens, steps=(), prompt=None, finish=None, rid="r1"):
    return SegmentRecord(rid, segment, "base", "day0", prompt_ids=prompt, tokens=list(tokens), steps=list(steps),
                         finish_reason=finish)


def test_segments_rebuild_the_context_and_train_prompt_positions_first():
    book = ContextBook()
    first = book.add(seg(0, [10, 11], prompt=[1, 2, 3]))
    assert first.tokens == [1, 2, 3, 10, 11] and first.first == 0 and first.start == 3
    assert list(first.positions) == [0, 1, 2]  # position j predicts token j+2: up to the last token
    second = book.add(seg(1, [12, 13, 14], finish="length"))
    assert second.tokens == [1, 2, 3, 10, 11, 12, 13, 14] and second.start == 5
    assert list(second.positions) == [3, 4, 5]  # predicting tokens at 5, 6, 7


def test_duplicates_and_orphans_give_nothing():
    book = ContextBook()
    assert book.add(seg(0, [5], prompt=[1, 2])) is not None
    assert book.add(seg(0, [5], prompt=[1, 2])) is None  # redelivered
    assert book.add(seg(2, [7], rid="r1")) is None and book.orphans == 1  # segment 1 never came
    assert book.add(seg(1, [7], rid="ghost")) is None and book.orphans == 2


def test_rejected_drafts_map_to_the_position_that_predicted_them():
    book = ContextBook()
    # step at position 4 drafted [20, 21, 22], accepted 1: token 21 at position 5 was rejected
    steps = [StepRecord(3, 0, [], [], 0, 10), StepRecord(4, 3, [20, 21, 22], [-0.1, -0.2, -0.3], 1, 30)]
    example = book.add(seg(0, [10, 20, 30], steps=steps, prompt=[1, 2, 3]))
    assert example.rejected == [(3, 21)]  # drafter position 3 predicts position 5
    assert example.steps[1] == (4, [20, 21, 22], 1)
    # the suffix index's drafts are not the head's: neither its steps nor its rejections are kept
    suffix_step = StepRecord(4, 3, [20, 21, 22], [0.0, 0.0, 0.0], 1, 30, proposer="suffix")
    other = book.add(seg(0, [10, 20, 30], steps=[steps[0], suffix_step], prompt=[1, 2, 3], rid="r2"))
    assert other.rejected == [] and len(other.steps) == 1


def test_segment_zero_without_prompt_is_an_error():
    with pytest.raises(ValueError, match="prompt"):
        ContextBook().add(seg(0, [1]))


def test_state_roundtrip():
    book = ContextBook()
    book.add(seg(0, [5], prompt=[1, 2]))
    again = ContextBook()
    again.load_state(book.state())
    assert again.add(seg(0, [5], prompt=[1, 2])) is None  # still knows it saw it
    assert again.add(seg(1, [6], finish="stop")).tokens == [1, 2, 5, 6]
