"""The trainer's simulated acceptance equals what the engine really accepts (greedy, fixed k)."""

from types import SimpleNamespace

import pytest
import torch

from specrl.speculation.sampling import SamplingParams
from specrl.speculation.simulate import heldout_acceptance, simulate_greedy
from tests.engine.conftest import chat_prompts


def test_simulated_walk_equals_the_engine(make_engine, tokenizer):
    # the full vocabulary: the tiny model's repeated tokens lie beyond the first 8192 ids, and
    # with none of them draftable the walk would be all zeros (a check that cannot fail)
    engine = make_engine(fixed_draft_tokens=4, max_draft_tokens=4, max_batch=2, draft_vocab_size=0)
    prompts = chat_prompts(tokenizer, 3)
    done = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for completion in done:
        [record] = [r for r in engine.sink.records if r.request_id == completion.request_id]
        engine_walk = [s.accepted for s in record.steps[1:]]  # after the prefill's token
        tokens = torch.tensor(completion.prompt_ids + record.tokens)
        with torch.inference_mode():
            features = engine.target(tokens[None])[0]
        sim = simulate_greedy(engine.drafter, features, tokens, len(completion.prompt_ids), k=4)
        assert sim.walk[: len(engine_walk)] == engine_walk
        assert sum(engine_walk) > 0  # the tiny model's repetitions make some drafts land


def test_heldout_acceptance_counts_every_position_with_k_known_tokens(make_engine, tokenizer):
    """The held-out profile: the walk's tokens per step averaged over requests, and a k-draft counted at
    every pending position whose k next tokens are known (none past the end), position by position."""
    engine = make_engine(fixed_draft_tokens=4, max_draft_tokens=4, max_batch=2, draft_vocab_size=0)
    prompts = chat_prompts(tokenizer, 2)
    done = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    heldout, sims = [], []
    for completion in done:
        [record] = [r for r in engine.sink.records if r.request_id == completion.request_id]
        tokens = completion.prompt_ids + record.tokens
        with torch.inference_mode():
            features = engine.target(torch.tensor(tokens)[None])[0][:-1]
        heldout.append((SimpleNamespace(tokens=tokens, start=len(completion.prompt_ids)), features))
        sims.append(simulate_greedy(engine.drafter, features, torch.tensor(tokens), len(completion.prompt_ids), k=4))
    length, counts = heldout_acceptance(engine.drafter, heldout, k=4)
    assert length == pytest.approx(sum(s.tau for s in sims) / len(sims))
    whole = [len(e.tokens) - 4 - e.start for e, _ in heldout]
    assert counts.num_drafts == sum(whole) and counts.num_draft_tokens == 4 * sum(whole)
    accepted = torch.cat([s.accepted[:w] for s, w in zip(sims, whole)])
    assert counts.num_accepted_tokens_per_pos == [int((accepted > i).sum()) for i in range(4)]
    rates = counts.per_position_acceptance_rate()
    assert rates[0] > 0 and all(a >= b for a, b in zip(rates, rates[1:]))
    assert heldout_acceptance(engine.drafter, [], k=4)[0] is None
