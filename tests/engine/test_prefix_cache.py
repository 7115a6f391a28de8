"""Prefix reuse (specrl/engine/prefix_cache.py): outputs and drafts equal a full prefill's, hits are
counted in prompt tokens as vLLM counts them, the n sequences of one prompt prefill it once, a swap
invalidates what the old weights computed, admission takes empty slots, then the least recently
used, never a running sequence's, and takes a kept entry in place only when it continues it."""

import random

import pytest
import torch

from specrl.engine.swap import load_swap
from specrl.speculation.sampling import SamplingParams
from tests.engine.conftest import chat_prompts
from tests.engine.test_speculative import assert_same_distribution
from tests.engine.test_swap import policy_v2  # noqa: F401 (a fixture: the tiny model, perturbed)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PLAIN = {"drafter": "none", "suffix_capacity": 0}  # no speculation, no calibration
HEAD = {"fixed_draft_tokens": 2, "suffix_capacity": 0}  # the day-0 head drafts 2 tokens every step


def distinct_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random prompts that share no first token (no common prefix)."""
    gen = random.Random(seed)
    return [[10 + i] + [gen.randrange(100, 5000) for _ in range(length - 1)] for i in range(n)]


def run_until_done(engine, seqs) -> int:
    """Step until every sequence in `seqs` has finished. -> steps taken."""
    steps = 0
    while any(s.finish_reason is None for s in seqs):
        engine.step()
        steps += 1
    return steps


def drafts_by_position(engine) -> dict[tuple[str, int], list[int]]:
    return {(r.request_id, s.position): s.draft_tokens for r in engine.sink.records for s in r.steps if s.k}


@pytest.mark.parametrize("speculation", [PLAIN, HEAD], ids=["plain", "head"])
def test_greedy_outputs_and_drafts_are_the_same_with_and_without_reuse(make_engine, tokenizer, speculation):
    """Chat prompts share the template's system prompt; the second round repeats the first. With
    the head, the drafter read the same features: wherever both runs drafted at a position, the
    drafts agree (their lengths may differ: a batch drafts at most what its shortest row has room for)."""
    prompts = chat_prompts(tokenizer, 6) * 2
    reuse = make_engine(max_batch=4, **speculation)
    full = make_engine(max_batch=4, prefix_cache=False, **speculation)
    with_reuse, without = reuse.generate(prompts, GREEDY), full.generate(prompts, GREEDY)
    assert [c.output_ids for c in with_reuse] == [c.output_ids for c in without]
    total = sum(map(len, prompts))
    assert full.stats.prompt_tokens_computed == total and full.stats.prefix_cache_hits == 0
    assert reuse.stats.prefix_cache_hits >= 6 * (len(prompts[0]) - 1)  # at least the repeated round
    assert reuse.stats.prompt_tokens_computed == total - reuse.stats.prefix_cache_hits
    if speculation is HEAD:
        a, b = drafts_by_position(reuse), drafts_by_position(full)
        common = [key for key in a if key in b]
        assert len(common) >= 50
        assert [key for key in common if a[key][: len(b[key])] != b[key][: len(a[key])]] == []


def test_seeded_sampling_is_the_same_with_and_without_reuse(make_engine, tokenizer):
    prompts = chat_prompts(tokenizer, 4) * 2
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=50 + i, ignore_eos=True) for i in range(8)]
    reuse = make_engine(max_batch=4, **HEAD)
    with_reuse = reuse.generate(prompts, params)
    without = make_engine(max_batch=4, prefix_cache=False, **HEAD).generate(prompts, params)
    assert [c.output_ids for c in with_reuse] == [c.output_ids for c in without]
    assert reuse.stats.prefix_cache_hits > 0


def test_sampled_tokens_follow_the_same_distribution_with_reuse(make_engine, tokenizer):
    """The same prompt sampled many times (a GRPO group): all but the first reuse its KV. Two-sample
    chi-square over the first two tokens against full prefills, reject at p < 1e-3; a low temperature
    keeps the support small enough for the test to have power (the tiny model's logits are flat)."""
    [prompt] = chat_prompts(tokenizer, 1)
    n = 500
    params = SamplingParams(max_tokens=2, temperature=0.14, ignore_eos=True)
    reuse = make_engine(max_batch=16, seed=1, **PLAIN)
    with_reuse = reuse.generate([prompt] * n, params)
    without = make_engine(max_batch=16, seed=2, prefix_cache=False, **PLAIN).generate([prompt] * n, params)
    assert reuse.stats.prefix_cache_hits >= (n - 16) * (len(prompt) - 1)
    assert_same_distribution([c.output_ids for c in with_reuse], [c.output_ids for c in without])


def test_hits_are_counted_in_prompt_tokens_as_vllm_counts_them(make_engine):
    """queries: every new request's prompt tokens; hits: those reused. The last position is always
    computed again (its logits sample the first token; the drafter needs its feature)."""
    engine = make_engine(**PLAIN)
    [p] = distinct_prompts(1, 40)
    q = p[:30] + [7] * 10
    stats = engine.stats

    def counts():
        return stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prompt_tokens_computed

    first = engine.submit(p, GREEDY)
    run_until_done(engine, [first])
    assert counts() == (40, 0, 40) and first.num_cached_tokens == 0
    again = engine.submit(p, GREEDY)
    run_until_done(engine, [again])
    assert counts() == (80, 39, 41) and again.num_cached_tokens == 39
    shared = engine.submit(q, GREEDY)
    run_until_done(engine, [shared])
    assert counts() == (120, 39 + 29, 41 + 11) and shared.num_cached_tokens == 29
    assert again.output_ids == first.output_ids


@pytest.mark.parametrize("speculation", [PLAIN, HEAD], ids=["plain", "head"])
def test_the_n_sequences_of_one_prompt_prefill_it_once(make_engine, speculation):
    """8 copies of a 300-token prompt submitted together (an n = 8 request) with 64-token prefill
    chunks: the first prefills it, the other 7 wait for it and compute one position each, so the
    8th first token comes one step after the first one; without reuse they share the chunk budget."""
    [prompt] = distinct_prompts(1, 300)

    def first_token_steps(engine) -> tuple[list[int], list]:
        seqs = [engine.submit(prompt, GREEDY) for _ in range(8)]
        firsts, step = [None] * 8, 0
        while engine.has_work():
            engine.step()
            step += 1
            for i, s in enumerate(seqs):
                if firsts[i] is None and s.output_ids:
                    firsts[i] = step
        return firsts, seqs

    reuse = make_engine(max_batch=8, prefill_chunk=64, **speculation)
    firsts, seqs = first_token_steps(reuse)
    assert reuse.stats.prompt_tokens_computed == 300 + 7 and reuse.stats.prefix_cache_hits == 7 * 299
    assert max(firsts) == min(firsts) + 1 == 6  # ceil(300 / 64) steps, then one more for the other 7
    full = make_engine(max_batch=8, prefill_chunk=64, prefix_cache=False, **speculation)
    full_firsts, full_seqs = first_token_steps(full)
    assert full.stats.prompt_tokens_computed == 8 * 300 and max(full_firsts) >= 8 * 300 // 64
    assert [s.output_ids for s in seqs] == [s.output_ids for s in full_seqs]
    assert len({tuple(s.output_ids) for s in seqs}) == 1


def test_a_drain_swap_reuses_nothing_the_old_policy_computed(make_engine, tokenizer, policy_v2):  # noqa: F811
    """A finished request's kept slot and a request still running on the old policy both hold the
    prompt's KV under the old weights: a request on the new policy reuses neither, then reuses its own."""
    [prompt] = chat_prompts(tokenizer, 1)
    [new_ref] = make_engine(model=str(policy_v2), **PLAIN).generate([prompt], GREEDY)
    engine = make_engine(max_batch=3, **PLAIN)
    engine.generate([prompt], GREEDY)
    old = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    hits = engine.stats.prefix_cache_hits
    assert hits == len(prompt) - 1  # the finished request's slot served it
    engine.request_swap(load_swap("policy", "p2", "drain", policy_v2, engine.target, plan=engine.plan))
    engine.step()
    new = engine.submit(prompt, GREEDY)
    run_until_done(engine, [new])
    assert engine.stats.prefix_cache_hits == hits and new.num_cached_tokens == 0
    assert new.output_ids == new_ref.output_ids and (old.target_version, new.target_version) == ("base", "p2")
    again = engine.submit(prompt, GREEDY)
    run_until_done(engine, [again, old])
    assert again.num_cached_tokens == len(prompt) - 1 and again.output_ids == new_ref.output_ids


def test_a_drafter_swap_invalidates_the_drafters_kv(make_engine, tokenizer, tmp_path):
    """The drafter's KV travels with the target's, so a new drafter starts a new epoch too."""
    from specrl.models.drafter import EagleDrafter

    [prompt] = chat_prompts(tokenizer, 1)
    engine = make_engine(**HEAD)
    engine.generate([prompt], GREEDY)
    EagleDrafter.day0(engine.target, seed=99).save(tmp_path)
    engine.request_swap(load_swap("drafter", "d2", "drain", tmp_path, engine.target))
    engine.step()
    engine.generate([prompt], GREEDY)
    assert engine.stats.prefix_cache_hits == 0
    engine.generate([prompt], GREEDY)
    assert engine.stats.prefix_cache_hits == len(prompt) - 1


def test_an_interrupt_recomputes_on_the_new_weights(make_engine, tokenizer, policy_v2):  # noqa: F811
    """Two sequences of one prompt move to new weights mid-answer: both recompute their KV (the
    second may reuse what the first recomputed, never what the old weights computed) and continue
    as the new policy continues their context; recomputes are no prefix-cache queries."""
    [prompt] = chat_prompts(tokenizer, 1)
    engine = make_engine(max_batch=2, **HEAD)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seqs = [engine.submit(prompt, params) for _ in range(2)]
    while len(seqs[0].output_ids) < 5:
        engine.step()
    queries = engine.stats.prefix_cache_queries
    engine.request_swap(load_swap("policy", "p2", "interrupt", policy_v2, engine.target, plan=engine.plan))
    engine.step()
    prefixes = [list(s.output_ids) for s in seqs]
    run_until_done(engine, seqs)
    assert engine.stats.prefix_cache_queries == queries
    new = make_engine(model=str(policy_v2), **PLAIN)
    for seq, prefix in zip(seqs, prefixes):
        [cont] = new.generate([prompt + prefix], SamplingParams(max_tokens=16 - len(prefix), temperature=0.0,
                                                                ignore_eos=True))
        assert seq.output_ids == prefix + cont.output_ids


def test_admission_takes_empty_slots_then_the_least_recently_used_never_a_running_one(make_engine):
    engine = make_engine(max_batch=3, **PLAIN)
    a, b, c, d = distinct_prompts(4, 24)
    long_params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)  # runs through all of it
    [long_ref] = make_engine(max_batch=1, prefix_cache=False, **PLAIN).generate([a], long_params)
    long = engine.submit(a, long_params)

    def run(prompt):
        seq = engine.submit(prompt, GREEDY)
        run_until_done(engine, [seq])
        return seq

    first_b, first_c = run(b), run(c)
    assert (long.slot, first_b.slot, first_c.slot) == (0, 1, 2)  # empty slots first, lowest first
    assert run(b).slot == first_b.slot  # its kept KV reused in place: b is now the most recently used
    assert run(d).slot == first_c.slot  # nothing matches d: the least recently used (c) goes, not the running a
    assert run(b).num_cached_tokens == len(b) - 1  # kept
    assert run(c).num_cached_tokens == 0  # evicted
    assert long.finish_reason is None
    run_until_done(engine, [long])
    assert long.output_ids == long_ref.output_ids


def test_prompts_sharing_a_short_head_keep_their_own_entries(make_engine):
    """Tenants whose long system prompts differ after a few shared tokens (a chat template's) take turns: each
    turn reuses its own tenant's prompt, however they alternate; none overwrites another's entry for the head."""
    engine = make_engine(max_batch=4, **PLAIN)
    head = [3, 4, 5, 6]
    tenants = [head + tail for tail in distinct_prompts(3, 40, seed=1)]
    reused = []
    for turn in range(3):
        for tenant in tenants:
            seq = engine.submit(tenant + [20 + turn], GREEDY)
            run_until_done(engine, [seq])
            reused.append(seq.num_cached_tokens)
    assert reused[:3] == [0, len(head) - 1, len(head) - 1]  # first sight: only the head (LCP - 1), copied
    assert reused[3:] == [len(tenants[0]) - 1] * 6  # every later turn: its whole tenant prompt


def test_random_traffic_keeps_slots_exclusive_and_outputs_exact(make_engine):
    """Prompts drawn from a few shared prefixes with random tails, random lengths, more requests
    than slots, small prefill chunks: at every step each running sequence has its own slot, and
    every output equals the one of full prefills."""
    gen = random.Random(3)
    stems = distinct_prompts(3, 40, seed=1)
    prompts = [gen.choice(stems)[: gen.randrange(5, 41)] + [gen.randrange(100, 5000) for _ in range(gen.randrange(0, 8))]
               for _ in range(24)]
    params = [SamplingParams(max_tokens=gen.randrange(1, 12), temperature=0.0, ignore_eos=True) for _ in prompts]
    engine = make_engine(max_batch=3, prefill_chunk=16, **HEAD)
    seqs = [engine.submit(p, q) for p, q in zip(prompts, params)]
    while engine.has_work():
        slots = [s.slot for s in engine.scheduler.running]
        assert len(slots) == len(set(slots))
        engine.step()
    full = make_engine(max_batch=3, prefill_chunk=16, prefix_cache=False, **PLAIN).generate(prompts, params)
    assert [s.output_ids for s in seqs] == [c.output_ids for c in full]
    assert engine.stats.prefix_cache_hits > 0


def test_kv_rows_are_copied_for_every_layer_of_both_caches(make_engine):
    """The copy moves positions [0, r) of one slot into another in the target's and the drafter's
    caches and nothing else."""
    engine = make_engine(max_batch=2, **HEAD)
    for cache in (engine.cache, engine.draft_cache):
        cache.k.copy_(torch.randn(cache.k.shape))
        cache.v.copy_(torch.randn(cache.v.shape))
    before = [(c.k.clone(), c.v.clone()) for c in (engine.cache, engine.draft_cache)]
    engine.prefix._copy(0, 1, 5)
    for cache, (k, v) in zip((engine.cache, engine.draft_cache), before):
        assert torch.equal(cache.k[:, 1, :, :5], k[:, 0, :, :5]) and torch.equal(cache.v[:, 1, :, :5], v[:, 0, :, :5])
        assert torch.equal(cache.k[:, 1, :, 5:], k[:, 1, :, 5:]) and torch.equal(cache.k[:, 0], k[:, 0])
