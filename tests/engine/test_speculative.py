"""Speculative decoding is exact: greedy output equals plain greedy decoding token for token,
and sampled output follows the target's distribution, also under vLLM's extra sampling
parameters (penalties, logit bias, min_tokens, top_k, min_p).

The sampled tests compare the speculative engine's completions with the exact law of their first
tokens (`prefix_law`: the target's processed distribution after every prefix it can sample, from
its logits), a one-sample chi-square: no plain-decoding sample to generate, and none of its noise
in the comparison."""

from dataclasses import replace

import pytest
import torch
from scipy.stats import chi2_contingency

from specrl.speculation.sampling import RowSampler, SamplingParams
from tests.engine.conftest import chat_prompts
from tests.kernels.conftest import assert_follows

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def assert_same_distribution(spec: list[list[int]], plain: list[list[int]]) -> None:
    """Two-sample chi-square over the token prefixes seen at least 10 times; reject at p < 1e-3."""
    pairs_spec, pairs_plain = [tuple(x) for x in spec], [tuple(x) for x in plain]
    support = sorted(set(pairs_spec) | set(pairs_plain))
    common = [p for p in support if pairs_spec.count(p) + pairs_plain.count(p) >= 10]
    table = [[pairs_spec.count(p) for p in common], [pairs_plain.count(p) for p in common]]
    assert len(common) >= 3
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)


@torch.inference_mode()
def prefix_law(engine, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """The probability of each sequence of `length` first tokens that plain decoding can sample
    after `prompt`: the product of the engine's target distributions after each prefix, processed
    as `params` ask (RowSampler.probs, the rule every decoding step samples by; the seed plays no
    part). One target forward per length over every reachable prefix."""
    target, law = engine.target, {(): 1.0}
    for _ in range(length):
        prefixes = list(law)
        rows = len(prefixes)
        tokens = torch.tensor([prompt + list(p) for p in prefixes])
        hidden = target(tokens, torch.arange(rows), torch.zeros(rows, dtype=torch.long),
                        target.new_cache(rows, tokens.shape[1]))
        sampler = RowSampler.of([replace(params, seed=None)] * rows, [torch.Generator() for _ in prefixes],
                                history=[(prompt, list(p)) for p in prefixes])
        probs = sampler.probs(target.logits(hidden[:, -1:]), eos_ids=target.cfg.eos_token_ids)[:, 0].double()
        law = {prefix + (token,): law[prefix] * float(probs[i, token])
               for i, prefix in enumerate(prefixes) for token in probs[i].nonzero().squeeze(1).tolist()}
    return law


def assert_prefixes_follow(completions, law: dict[tuple[int, ...], float]) -> None:
    """The completions' first tokens follow `law` (prefix_law): chi-square goodness of fit, reject
    at p < 1e-3 (tests/kernels/conftest.py: assert_follows); a prefix expected fewer than 5 times
    is counted with the others of its first token; one the target cannot sample fails at once."""
    length, n = len(next(iter(law))), len(completions)
    cell = {prefix: prefix if p * n >= 5 else prefix[:1] for prefix, p in law.items()}
    cells = sorted(set(cell.values()))
    index = {c: i for i, c in enumerate(cells)}
    probs = torch.zeros(len(cells), dtype=torch.float64)
    for prefix, p in law.items():
        probs[index[cell[prefix]]] += p
    seen = [tuple(c.output_ids[:length]) for c in completions]
    assert all(len(s) == length for s in seen)
    impossible = [s for s in seen if s not in law]
    assert not impossible, f"prefixes the target never samples: {impossible[:5]}"
    assert len(cells) >= 3
    assert_follows(torch.tensor([index[cell[s]] for s in seen]), probs, f"first {length} tokens")


# -1: the adaptive controller; int8: the target actually served is the quantized one, and speculation is exact
# against it (the plain engine quantizes the same way)
@pytest.mark.parametrize("fixed_k, dtype", [(1, "auto"), (3, "auto"), (-1, "auto"), (3, "int8"), (-1, "int8"), (3, "q4")])
def test_greedy_speculation_equals_plain_greedy_tiny(make_engine, tokenizer, fixed_k, dtype):
    prompts = chat_prompts(tokenizer, 10)
    plain = make_engine(drafter="none", max_batch=4, dtype=dtype).generate(prompts, GREEDY)
    spec_engine = make_engine(max_batch=4, fixed_draft_tokens=fixed_k, max_draft_tokens=4, dtype=dtype)
    assert (spec_engine.target.layers[0].qkv.dtype in (torch.int8, torch.quint4x2)) == (dtype in ("int8", "q4"))
    spec = spec_engine.generate(prompts, GREEDY)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    if fixed_k > 0:  # the speculative path really ran, and accepted some drafts
        assert sum(c.spec.num_draft_tokens for c in spec) > 0 and sum(c.spec.num_accepted_tokens for c in spec) > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["day0", "pretrained"])  # pretrained: the head shipped for SmolLM2
def test_greedy_speculation_equals_plain_greedy_smollm2(make_engine, tokenizer, drafter):
    prompts = chat_prompts(tokenizer, 8)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = make_engine(model="smollm2-135m", drafter="none", max_batch=4).generate(prompts, params)
    engine = make_engine(model="smollm2-135m", drafter=drafter, max_batch=4, fixed_draft_tokens=4)
    assert engine.drafter_version.startswith(drafter)
    spec = engine.generate(prompts, params)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert sum(c.spec.num_draft_tokens for c in spec) > 0


@pytest.mark.parametrize("dtype", ["auto", "int8"])  # int8: the law of the quantized target, the one served
def test_sampled_tokens_follow_the_target_distribution(make_engine, tokenizer, dtype):
    """The token drawn by the verify step (accepted draft or recovered token) follows the target's
    distribution: the first two tokens against their exact law, chi-square, reject at p < 1e-3.
    top_p keeps the support small enough for the test to have power."""
    [prompt] = chat_prompts(tokenizer, 1)
    n = 1500
    params = [SamplingParams(max_tokens=3, temperature=0.5, top_p=0.05, seed=i, ignore_eos=True) for i in range(n)]
    spec_engine = make_engine(max_batch=8, fixed_draft_tokens=1, dtype=dtype)
    spec = spec_engine.generate([prompt] * n, params)
    accepted = sum(c.spec.num_accepted_tokens for c in spec)
    assert 0 < accepted < sum(c.spec.num_draft_tokens for c in spec), "both accept and reject paths must be exercised"
    assert_prefixes_follow(spec, prefix_law(spec_engine, prompt, params[0], 2))


# the suffix index alone, and beside the head; int8 weights with both
@pytest.mark.parametrize("drafter, dtype", [("none", "auto"), ("day0", "auto"), ("day0", "int8")])
def test_greedy_with_the_suffix_index_equals_plain_greedy(make_engine, tokenizer, drafter, dtype):
    prompts = chat_prompts(tokenizer, 6) * 2  # the second round finds the first in the index
    plain = make_engine(drafter="none", suffix_capacity=0, max_batch=4, dtype=dtype).generate(prompts, GREEDY)
    engine = make_engine(drafter=drafter, max_batch=4, max_draft_tokens=4, dtype=dtype)
    spec = engine.generate(prompts, GREEDY)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    suffix = engine.stats.by_proposer["suffix"]
    assert suffix.num_accepted_tokens > 0  # the suffix path really ran and paid
    assert max(len(r.steps) for r in engine.sink.records) >= 1
    steps = [s for r in engine.sink.records for s in r.steps]
    assert {s.proposer for s in steps if s.k} <= {"head", "suffix"} and any(s.proposer == "suffix" for s in steps)
    assert all(s.proposer == "" for s in steps if s.k == 0)


def test_a_sample_behind_drafts_from_its_running_peers_text(make_engine, tokenizer):
    """Two requests with one prompt (the n samples of a request, a GRPO group): the one that starts
    later drafts from the text the first has written so far, before it finishes (nothing is in the
    global index yet), and its output is still plain greedy's."""
    prompt = chat_prompts(tokenizer, 1)[0]
    [plain] = make_engine(drafter="none", suffix_capacity=0).generate([prompt], GREEDY)
    engine = make_engine(drafter="none", max_batch=4)
    ahead = engine.submit(prompt, GREEDY, request_id="ahead")
    while len(ahead.output_ids) < 16:
        engine.step()
    behind = engine.submit(prompt, GREEDY, request_id="behind")
    while engine.has_work():
        engine.step()
    assert engine.suffix.documents == 2  # both joined the index only as they finished
    assert ahead.output_ids == behind.output_ids == plain.output_ids
    # its first decode step (one token of its own output: no earlier text of its own to match)
    first = next(s for r in engine.sink.records if r.request_id == "behind" for s in r.steps
                 if s.position == len(prompt) + 1)
    assert first.proposer == "suffix" and first.accepted >= 2  # what the peer had written


@pytest.mark.parametrize("seeded", [False, True])  # rejection sampling with q = the votes; the coupled rule
def test_sampled_tokens_follow_the_target_distribution_with_suffix_drafts(make_engine, tokenizer, seeded):
    """Suffix drafts of sampled rows are drawn from the votes (q = the vote distribution), of seeded
    rows the most voted token (q one-hot): the verified tokens still follow the target, under both
    acceptance rules (specrl/speculation/verify.py). The same prompt sampled many times (a GRPO group) is
    where the index's occurrences disagree. The first two tokens against their exact law,
    chi-square, reject at p < 1e-3."""
    [prompt] = chat_prompts(tokenizer, 1)
    n = 1500
    params = [SamplingParams(max_tokens=3, temperature=0.5, top_p=0.05, seed=i if seeded else None, ignore_eos=True)
              for i in range(n)]
    engine = make_engine(drafter="none", max_batch=8, seed=1)
    spec = engine.generate([prompt] * n, params)
    suffix = engine.stats.by_proposer["suffix"]
    assert 0 < suffix.num_accepted_tokens < suffix.num_draft_tokens, "both accept and reject paths must be exercised"
    drafted = [s for r in engine.sink.records for s in r.steps if s.proposer == "suffix" and s.k]
    split = [s for s in drafted if any(lp < 0 for lp in s.draft_logprobs)]  # drawn from votes that disagreed
    assert (not split) if seeded else len(split) > len(drafted) // 4
    assert_prefixes_follow(spec, prefix_law(engine, prompt, params[0], 2))


def test_a_seed_reproduces_the_same_text_whatever_speculation_does(make_engine, tokenizer):
    """Seeded sampling: the random number of the token at position n depends on (seed, n) only, so
    plain decoding, the head at any k, the suffix index and the adaptive controller all give the
    same tokens; a different seed gives other tokens."""
    prompts = chat_prompts(tokenizer, 4) * 2
    params = [SamplingParams(max_tokens=20, temperature=0.7, top_p=0.5, seed=100 + i % 4, ignore_eos=True)
              for i in range(8)]
    plain = make_engine(drafter="none", suffix_capacity=0, max_batch=4).generate(prompts, params)
    assert [c.output_ids for c in plain[:4]] == [c.output_ids for c in plain[4:]]  # the same seed, the same text
    engines = {"head k=1": make_engine(max_batch=4, fixed_draft_tokens=1, suffix_capacity=0),
               "head k=3": make_engine(max_batch=4, fixed_draft_tokens=3, suffix_capacity=0),
               "suffix": make_engine(drafter="none", max_batch=4),
               "adaptive": make_engine(max_batch=4)}
    for name, engine in engines.items():
        out = engine.generate(prompts, params)
        assert [c.output_ids for c in out] == [c.output_ids for c in plain], name
        assert engine.stats.spec.num_draft_tokens > 0, name  # the speculative path ran, and the text did not move
    assert engines["suffix"].stats.spec.num_accepted_tokens > 0
    other = make_engine(drafter="none", suffix_capacity=0).generate(prompts[:1], [params[0].__class__(
        **{**params[0].__dict__, "seed": 999})])
    assert other[0].output_ids != plain[0].output_ids


# ---- vLLM's extra sampling parameters: speculation stays exact under the processing ------------

PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.5)


@pytest.mark.parametrize("drafter, fixed_k", [("day0", 1), ("day0", 3), ("none", -1)])  # head k=1, k=3; suffix index
def test_greedy_with_penalties_and_logit_bias_equals_plain_greedy(make_engine, tokenizer, drafter, fixed_k):
    """Penalties count the drafts before each verified position: the verified argmax is plain
    decoding's after the same tokens, so the text is plain greedy's token for token."""
    prompts = chat_prompts(tokenizer, 6) * 2  # the second round finds the first in the suffix index
    params = [replace(GREEDY, logit_bias=((1000 + 7 * i, 3.0), (2000 + i, -5.0)), **PENALTIES) for i in range(12)]
    plain = make_engine(drafter="none", suffix_capacity=0, max_batch=4).generate(prompts, params)
    unpenalised = make_engine(drafter="none", suffix_capacity=0, max_batch=4).generate(prompts, GREEDY)
    assert sum(a.output_ids != b.output_ids for a, b in zip(plain, unpenalised)) >= 6  # the processing bites
    engine = make_engine(drafter=drafter, max_batch=4, fixed_draft_tokens=fixed_k, max_draft_tokens=4)
    spec = engine.generate(prompts, params)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert engine.stats.spec.num_draft_tokens > 0 and engine.stats.spec.num_accepted_tokens > 0


def test_min_tokens_holds_back_eos_at_every_draft_position(make_engine, tokenizer):
    """EOS biased by +100 ends every request at once; with min_tokens=5 it comes exactly after 5
    tokens, also when a step verifies drafts across the min_tokens boundary."""
    eos, prompts = tokenizer.eos_token_id, chat_prompts(tokenizer, 4)
    forced = SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((eos, 100.0),))
    for engine in (make_engine(drafter="none", suffix_capacity=0), make_engine(fixed_draft_tokens=3, max_batch=4)):
        assert all(c.output_ids == [] and c.finish_reason == "stop" for c in engine.generate(prompts, forced))
        held = engine.generate(prompts, replace(forced, min_tokens=5))
        assert all(len(c.output_ids) == 5 and c.finish_reason == "stop" for c in held), [c.output_ids for c in held]
    assert engine.stats.spec.num_draft_tokens > 0


@pytest.mark.parametrize("proposer, seeded", [("head", False), ("suffix", True)])  # rejection sampling; coupled
def test_sampled_tokens_follow_the_processed_target_distribution(make_engine, tokenizer, proposer, seeded):
    """top_k, min_p and the three penalties, speculative (head drafts at k = 2, or the suffix index's):
    the first three tokens follow their exact law (chi-square, reject at p < 1e-3). Each token's
    distribution depends on the ones before it through the penalties, which the verify step
    counts when they came from accepted drafts of the same step."""
    [prompt] = chat_prompts(tokenizer, 1)
    n = 1500
    # max_tokens 4: the step after the first token has room for k = 2 drafts (and the bonus token)
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, min_p=0.1, ignore_eos=True,
                             seed=i if seeded else None, repetition_penalty=1.5, presence_penalty=1.0,
                             frequency_penalty=0.5) for i in range(n)]
    engine = (make_engine(max_batch=8, fixed_draft_tokens=2, suffix_capacity=0, seed=1) if proposer == "head"
              else make_engine(drafter="none", max_batch=8, seed=1))
    spec = engine.generate([prompt] * n, params)
    counts = engine.stats.by_proposer[proposer]
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, "both accept and reject paths must be exercised"
    assert_prefixes_follow(spec, prefix_law(engine, prompt, params[0], 3))


def test_a_seed_reproduces_a_processed_sample_whatever_speculation_does(make_engine, tokenizer):
    """The coupled rule under top_k, min_p and penalties: plain decoding, the head and the suffix
    index give the same tokens for the same seed."""
    prompts = chat_prompts(tokenizer, 4) * 2
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, min_p=0.02, seed=200 + i % 4, ignore_eos=True,
                             **PENALTIES) for i in range(8)]
    plain = make_engine(drafter="none", suffix_capacity=0, max_batch=4).generate(prompts, params)
    for name, engine in {"head k=3": make_engine(max_batch=4, fixed_draft_tokens=3, suffix_capacity=0),
                         "suffix": make_engine(drafter="none", max_batch=4)}.items():
        out = engine.generate(prompts, params)
        assert [c.output_ids for c in out] == [c.output_ids for c in plain], name
        assert engine.stats.spec.num_draft_tokens > 0, name
