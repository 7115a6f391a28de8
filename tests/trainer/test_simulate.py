"""The trainer's simulated acceptance equals what the engine really accepts (greedy, fixed k)."""

import torch

from specrl.speculation.sampling import SamplingParams
from specrl.speculation.simulate import simulate_greedy
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
