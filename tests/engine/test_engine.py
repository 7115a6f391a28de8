"""Engine mechanics: continuous batching, bounded queue, stops, chunked prefill, abort, records."""

import asyncio
import json

import pytest

from specrl.errors import InvalidRequestError, ModelNotFoundError, QueueFullError
from specrl.serving.engine_loop import EngineLoop
from specrl.engine.sequence import Status
from specrl.speculation.sampling import SamplingParams
from tests.engine.conftest import chat_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_continuous_batching_admits_as_slots_free(make_engine, tokenizer):
    """5 requests, 2 slots: never more than 2 running, a short request admitted late still
    finishes before the long one (no starvation), and each output equals the request run alone."""
    engine = make_engine(max_batch=2, fixed_draft_tokens=2)
    prompts = chat_prompts(tokenizer, 5)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] + \
             [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 4
    seqs = [engine.submit(p, q) for p, q in zip(prompts, params)]
    finished_order = []
    while engine.has_work():
        assert len(engine.scheduler.running) <= 2
        for out in engine.step():
            if out.finished:
                finished_order.append(out.request_id)
    assert finished_order[-1] == seqs[0].request_id  # the long one ends last; short ones went through beside it
    assert all(s.status is Status.FINISHED for s in seqs)
    alone = make_engine(max_batch=1, drafter="none").generate(prompts, params)
    assert [s.output_ids for s in seqs] == [c.output_ids for c in alone]


def test_queue_bound_refuses_with_a_clear_error(make_engine, tokenizer):
    engine = make_engine(max_batch=1, max_waiting=2)
    prompt = chat_prompts(tokenizer, 1)[0]
    engine.submit(prompt, GREEDY)
    engine.submit(prompt, GREEDY)
    with pytest.raises(QueueFullError, match="saturated"):
        engine.submit(prompt, GREEDY)


@pytest.mark.parametrize("prompt,params,param,message", [
    ([], GREEDY, "prompt", "empty"),
    ([1] * 64, GREEDY, "prompt", "the context is 64"),
    ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens", ">= 1"),
    ([1, 2, 3], SamplingParams(max_tokens=62), "max_tokens", "exceeds the context of 64"),
    ([1, -5], GREEDY, "prompt", "token ids"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature", "temperature"),
])
def test_bad_requests_are_refused_before_any_work(make_engine, prompt, params, param, message):
    engine = make_engine(max_seq_len=64)
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.submit(prompt, params)
    assert info.value.param == param
    assert not engine.has_work()


def test_unknown_model_alias(make_engine):
    with pytest.raises(ModelNotFoundError, match="unknown model 'nope'"):
        make_engine(model="nope")


def test_stop_token_ids_and_stop_strings(make_engine, tokenizer):
    engine = make_engine(drafter="none")
    prompt = chat_prompts(tokenizer, 1)[0]
    [free] = engine.generate([prompt], GREEDY)
    stop_id = free.output_ids[5]
    [by_id] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=(stop_id,)))
    first = free.output_ids.index(stop_id)
    assert by_id.output_ids == free.output_ids[:first] and by_id.finish_reason == "stop"
    stop_text = tokenizer.decode(free.output_ids[3:5])
    [by_text] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                         stop=(stop_text,)))
    assert by_text.finish_reason == "stop" and stop_text in by_text.text
    assert len(by_text.output_ids) <= 5
    assert free.finish_reason == "length" and len(free.output_ids) == 16


def test_eos_ends_the_request_and_is_not_shown(make_engine, tokenizer):
    engine = make_engine(drafter="none")
    prompt = chat_prompts(tokenizer, 1)[0]
    [free] = engine.generate([prompt], GREEDY)
    eos = free.output_ids[2]
    engine.eos_ids = frozenset({eos})  # pretend that token is EOS
    [done] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    assert done.output_ids == free.output_ids[: free.output_ids.index(eos)] and done.finish_reason == "stop"


def test_chunked_prefill_gives_the_same_output(make_engine, tokenizer):
    prompts = chat_prompts(tokenizer, 3)
    whole = make_engine(prefill_chunk=512).generate(prompts, GREEDY)
    chunked = make_engine(prefill_chunk=7, fixed_draft_tokens=2).generate(prompts, GREEDY)
    assert [c.output_ids for c in chunked] == [c.output_ids for c in whole]


def test_abort_frees_the_slot(make_engine, tokenizer):
    engine = make_engine(max_batch=1)
    a, b = chat_prompts(tokenizer, 2)
    first = engine.submit(a, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    second = engine.submit(b, GREEDY)
    engine.step()
    engine.abort(first.request_id)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert first.finish_reason == "abort" and len(first.output_ids) < 50
    assert second.finish_reason == "length" and len(second.output_ids) == 16


def test_records_cover_every_committed_token(make_engine, tokenizer):
    """Every request's segment records, concatenated, hold its prompt and exactly the tokens it
    committed; every step obeys tokens = drafts[:accepted] + [target_token]; segments hold <= 64 steps."""
    engine = make_engine(fixed_draft_tokens=3, max_batch=3)
    prompts = chat_prompts(tokenizer, 4)
    done = engine.generate(prompts, SamplingParams(max_tokens=150, temperature=0.7, seed=1, ignore_eos=True))
    by_request = {}
    for record in engine.sink.records:
        by_request.setdefault(record.request_id, []).append(record)
    for completion in done:
        records = sorted(by_request[completion.request_id], key=lambda r: r.segment)
        assert [r.segment for r in records] == list(range(len(records))) and len(records) >= 2
        assert records[0].prompt_ids == completion.prompt_ids and all(r.prompt_ids is None for r in records[1:])
        assert records[-1].finish_reason == "length" and all(r.finish_reason is None for r in records[:-1])
        tokens, position = [], len(completion.prompt_ids)
        for record in records:
            assert len(record.steps) <= 64
            assert (record.target_version, record.drafter_version) == ("base", "day0")
            step_tokens = []
            for step in record.steps:
                assert step.position == position + len(step_tokens)
                assert len(step.draft_tokens) == len(step.draft_logprobs) == step.k
                assert all(lp <= 0 for lp in step.draft_logprobs)
                step_tokens += step.draft_tokens[: step.accepted] + [step.target_token]
            assert step_tokens == record.tokens
            tokens += record.tokens
            position += len(record.tokens)
        assert tokens[: len(completion.output_ids)] == completion.output_ids
        assert sum(r.spec_counts().num_accepted_tokens for r in records) == completion.spec.num_accepted_tokens


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_last_segment_carries_the_finish_reason_when_it_is_exactly_full(make_engine, tokenizer, extra):
    """Plain decoding commits one token per step: a request ending on its segment's last step
    (or just around it) still stamps its finish reason on its last record."""
    from specrl.telemetry.record import SEGMENT_STEPS

    engine = make_engine(fixed_draft_tokens=0)
    [done] = engine.generate(chat_prompts(tokenizer, 1),
                             SamplingParams(max_tokens=SEGMENT_STEPS + extra, temperature=0.0, ignore_eos=True))
    records = sorted(engine.sink.records, key=lambda r: r.segment)
    assert sum(len(r.tokens) for r in records) == len(done.output_ids) == SEGMENT_STEPS + extra
    assert records[-1].finish_reason == "length" and all(r.finish_reason is None for r in records[:-1])


def test_record_roundtrips_through_msgpack(make_engine, tokenizer):
    from specrl.telemetry.record import SegmentRecord

    engine = make_engine(fixed_draft_tokens=2)
    engine.generate(chat_prompts(tokenizer, 1), GREEDY)
    [record] = engine.sink.records
    assert SegmentRecord.from_msgpack(record.to_msgpack()) == record
    with pytest.raises(ValueError, match="schema"):
        SegmentRecord.from_msgpack(b"\x81\xa6schema\x63")


@pytest.mark.slow
def test_controller_backs_off_an_untrained_drafter(make_engine, tokenizer):
    """With the day-0 drafter on SmolLM2, drafts are rarely accepted: the controller must spend
    most steps at k = 0 (probes only)."""
    engine = make_engine(model="smollm2-135m", max_batch=4)
    engine.generate(chat_prompts(tokenizer, 4), SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    steps = [s for r in engine.sink.records for s in r.steps[1:]]  # after the prefill's token
    speculative = [s for s in steps if s.k > 0]
    assert len(speculative) <= 0.25 * len(steps), (len(speculative), len(steps))


def test_a_reader_that_goes_away_aborts_its_request(make_engine, tokenizer):
    """The serving loop's outputs(): closing the reader mid-request (a client gone) aborts the
    request in the engine at once and forgets its queue; a request read to the end is forgotten too."""
    loop = EngineLoop(make_engine(max_batch=2))
    loop.start()
    long_prompt, short_prompt = chat_prompts(tokenizer, 2)

    async def scenario():
        seq = loop.submit(long_prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), "gone")
        reader = loop.outputs("gone")
        first = await anext(reader)
        await reader.aclose()
        done = loop.submit(short_prompt, GREEDY, "read")
        outs = [out async for out in loop.outputs("read")]
        return seq, first, done, outs

    try:
        seq, first, done, outs = asyncio.run(scenario())
    finally:
        loop.stop(timeout=5)
    assert not first.finished and seq.finish_reason == "abort" and len(seq.output_ids) < 400
    assert outs[-1].finished and done.finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == len(done.output_ids) == 16
    assert loop._queues == {}


def test_the_cost_prior_never_prices_a_wider_forward_below_a_narrower_one(make_engine):
    """The start-up calibration times B = 1 and max_batch at every verify width; a forward over more
    rows or positions is never priced below a smaller one (timing noise on a tiny model is large)."""
    engine = make_engine(max_batch=6)
    target = engine.controller.costs.target
    assert sorted({b for b, _ in target}) == [1, 6]
    widths = sorted({t for _, t in target})
    assert widths[0] == 1 and widths[-1] == max(engine.settings.max_draft_tokens, engine.settings.suffix_max_tokens) + 1
    for (b, t), cost in target.items():
        assert all(cost >= target[(b2, t2)] for (b2, t2) in target if b2 <= b and t2 <= t)


def test_the_cost_prior_is_timed_once_then_read_from_beside_the_calibration(make_engine):
    """A restart reads the prior its first start timed (a restarted replica skips the timing); an unreadable file
    is timed again and replaced; another batch size has a prior of its own."""
    from specrl.speculation.controller import CostModel

    path = make_engine(max_batch=3).cost_prior_path()
    path.unlink()
    timed = make_engine(max_batch=3)
    assert path.is_file()
    read = make_engine(max_batch=3)
    assert (read.controller.costs.target, read.controller.costs.draft) == (timed.controller.costs.target,
                                                                           timed.controller.costs.draft)
    path.write_text("{half a file")
    again = make_engine(max_batch=3)
    assert CostModel.prior_from_dict(json.loads(path.read_text())).target == again.controller.costs.target
    assert make_engine(max_batch=4).cost_prior_path() != path
