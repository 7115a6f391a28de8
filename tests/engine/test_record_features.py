"""The target's features in the records (schema 4) and the engine's computed-twice counters."""

import torch

from specrl.config import Settings
from specrl.engine.engine import Engine
from specrl.engine.outputs import EngineStats, SeenPrefixes
from specrl.models.llama import load_llama
from specrl.speculation.sampling import SamplingParams
from specrl.telemetry.sink import MemorySink
from tests.engine.conftest import chat_prompts

GREEDY = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)  # more than one 64-step segment


def contexts(records):
    """request id -> [(record, context tokens through it, its segment's first position)]."""
    out, tokens = {}, {}
    for r in records:
        if r.segment == 0:
            tokens[r.request_id] = list(r.prompt_ids)
        start = len(tokens[r.request_id])
        tokens[r.request_id] = tokens[r.request_id] + r.tokens
        out.setdefault(r.request_id, []).append((r, list(tokens[r.request_id]), start))
    return out


def test_records_carry_the_targets_hidden_states_of_every_position_it_computed(home, tiny_dir, tokenizer):
    settings = Settings.load(home=home, model="tiny-random", dtype="float32", max_batch=4, fixed_draft_tokens=3)
    sink = MemorySink(features_max_bytes=1 << 22)
    engine = Engine.from_settings(settings, sink=sink, progress=False)
    prompts = chat_prompts(tokenizer, 3)  # the same chat template: later prompts reuse the first's KV
    engine.generate(prompts, GREEDY)
    target = load_llama(tiny_dir)
    starts, by_request = [], contexts(sink.records)
    assert any(len(segments) >= 2 for segments in by_request.values())
    for segments in by_request.values():
        for record, tokens, start in segments:
            assert record.feature_dim == target.cfg.hidden_size and record.feature_problem(64, 1 << 22) is None
            # consecutive positions from the first the engine computed up to the next-to-last token
            assert record.feature_start + record.feature_rows == len(tokens) - 1
            assert record.feature_start <= start - 1
            if record.segment > 0:
                assert record.feature_start == start - 1  # the segment's first pending token
            else:
                starts.append(record.feature_start)
            reference = target(torch.tensor(tokens)[None])[0][record.feature_start: len(tokens) - 1]
            shipped = record.feature_tensor().float()
            assert torch.allclose(shipped, reference, rtol=2e-3, atol=2e-3 * reference.abs().max())
    assert starts[0] == 0 and max(starts) > 0  # the prefix cache served the later prompts' first positions


def test_a_sink_that_takes_no_features_gets_none(make_engine, tokenizer):
    engine = make_engine(fixed_draft_tokens=2)  # MemorySink(): features_max_bytes 0
    engine.generate(chat_prompts(tokenizer, 2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert engine.sink.records and all(r.features is None for r in engine.sink.records)


def test_a_prompt_seen_before_is_counted_when_prefilled_again(make_engine, tokenizer):
    engine = make_engine(prefix_cache=False, drafter="none")
    prompt = chat_prompts(tokenizer, 1)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], params)
    assert engine.stats.prompt_tokens_repeated == 0
    engine.generate([prompt], params)
    whole = len(prompt) // SeenPrefixes.BLOCK * SeenPrefixes.BLOCK  # the partial last block never counts
    assert engine.stats.prompt_tokens_repeated == whole > 0
    cached = make_engine(drafter="none")  # with the prefix cache the second prefill computes 1 position
    cached.generate([prompt], params)
    cached.generate([prompt], params)
    assert cached.stats.prompt_tokens_repeated == 0


def test_prefill_chunks_and_recomputes_count_apart():
    stats = EngineStats()
    prompt = list(range(40))
    stats.count_prefill(prompt, 0, 20, recompute=False)
    stats.count_prefill(prompt, 20, 40, recompute=False)  # its own chunks never count against it
    assert stats.prompt_tokens_repeated == 0
    stats.count_prefill(prompt, 0, 40, recompute=False)  # seen: 2 whole blocks of 16
    assert stats.prompt_tokens_repeated == 32
    stats.count_prefill(prompt[:20] + [99] * 20, 0, 40, recompute=False)  # shares the first block only
    assert stats.prompt_tokens_repeated == 48
    stats.count_prefill(prompt, 0, 45, recompute=True)
    assert stats.kv_recomputed_tokens == 45 and stats.prompt_tokens_repeated == 48
