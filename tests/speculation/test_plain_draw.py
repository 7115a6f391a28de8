"""A plain sampled step's draw straight from the logits (`_cpu_kernels.sample_rows`, `RowSampler.draw`): the law
of softmax(logits / T) by the inverse CDF, ids of weight 0 never drawn, the log normaliser, and which batches take
it (unseeded rows without filters or processing; seeded rows keep torch's draw, which their speculative steps make
too)."""

import pytest
import torch

from specrl.models.linear import cpu_kernels
from specrl.models.llama import load_llama
from specrl.speculation.propose import Draft
from specrl.speculation.sampling import RowSampler, SamplingParams, top_k_filter
from specrl.speculation.verify import verify
from tests.kernels.conftest import assert_follows
from tests.models.test_prepared import ForcedPlan

pytestmark = pytest.mark.skipif(cpu_kernels is None, reason="the C kernels are not built")


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor, portable: bool = False,
                top_k: torch.Tensor | None = None):
    """logits [R, V] -> (tokens [R], log normaliser [R]) through the C kernel; top_k [R] int64 (0: off) or None."""
    rows, vocab = logits.shape
    tokens, log_normaliser = torch.empty(rows, dtype=torch.long), torch.empty(rows)
    # held in names for the call: a pointer into a temporary would be freed under the kernel
    logits, inverse, uniforms = logits.contiguous(), (1.0 / temperature).float().contiguous(), uniforms.float().contiguous()
    top_k = None if top_k is None else top_k.long().contiguous()
    cpu_kernels.sample_rows(tokens.data_ptr(), log_normaliser.data_ptr(), logits.data_ptr(), rows, vocab,
                            inverse.data_ptr(), uniforms.data_ptr(), 0 if top_k is None else top_k.data_ptr(), 2,
                            portable)
    return tokens, log_normaliser


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vocab, temperature", [(13, 1.0), (100, 0.6), (1000, 1.7)])  # tails past 8 and 64 ids
def test_draws_follow_softmax_at_the_temperature(portable, vocab, temperature):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * 2
    logits[3] = float("-inf")  # a masked id
    logits[5] = -1000.0  # and one whose weight underflows
    n = 20000
    tokens, log_normaliser = sample_rows(logits.expand(n, -1), torch.full((n,), temperature),
                                         torch.rand(n, generator=g), portable)
    assert_follows(tokens, torch.softmax(logits.double() / temperature, -1), f"V={vocab} T={temperature}")
    assert not bool(((tokens == 3) | (tokens == 5)).any())
    torch.testing.assert_close(log_normaliser, torch.logsumexp(logits / temperature, -1).expand(n), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vocab, k", [(100, 7), (1000, 1), (1000, 40), (300, 300)])
def test_top_k_draws_follow_the_k_most_likely(portable, vocab, k):
    """The law of torch's top_k_filter (specrl.speculation.sampling): the k most likely ids renormalised; an id tied
    with the k-th stays; rows without top_k (0) in the same call keep every id."""
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(vocab, generator=g) * 2
    order = logits.argsort(descending=True)
    if k < vocab:
        logits[order[k]] = logits[order[k - 1]]  # a tie with the k-th
    n, temperature = 20000, 0.8
    probs = torch.softmax(logits.double() / temperature, -1)
    kept = top_k_filter(probs[None, None].float(), torch.tensor([k]))[0, 0].double()
    assert int((kept > 0).sum()) == min(k + 1, vocab)
    tokens, log_normaliser = sample_rows(logits.expand(n, -1), torch.full((n,), temperature), torch.rand(n, generator=g),
                                         portable, torch.full((n,), k))
    assert_follows(tokens, kept, f"V={vocab} k={k}")
    torch.testing.assert_close(log_normaliser[:1], torch.logsumexp(logits[kept > 0] / temperature, -1)[None],
                               rtol=1e-5, atol=1e-5)
    mixed = torch.tensor([k, 0] * 2000)
    tokens, _ = sample_rows(logits.expand(4000, -1), torch.full((4000,), temperature), torch.rand(4000, generator=g),
                            portable, mixed)
    assert bool((kept[tokens[::2]] > 0).all()) and (k >= vocab - 1 or bool((kept[tokens[1::2]] == 0).any()))


@pytest.mark.parametrize("portable", [False, True])
def test_the_draw_is_the_inverse_cdf_of_its_uniform(portable):
    """p = [0.1, 0.2, 0.3, 0.4]: u below 0.1 draws id 0, in [0.1, 0.3) id 1, [0.3, 0.6) id 2, from 0.6 id 3."""
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().expand(8, -1)
    u = torch.tensor([0.0, 0.05, 0.15, 0.29, 0.31, 0.59, 0.61, 0.999999])
    tokens, _ = sample_rows(logits, torch.ones(8), u, portable)
    assert tokens.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_vocabulary_of_49k_draws_what_torchs_inverse_cdf_draws():
    """The same rule as kernels/verify.py's softmax, cumsum and searchsorted: the same id but where a uniform
    falls within float rounding of a boundary (here under 1% of draws)."""
    from specrl.kernels import inverse_cdf_sample

    g = torch.Generator().manual_seed(0)
    logits, u = torch.randn(64, 49152, generator=g) * 3, torch.rand(64, generator=g)
    for temperature in (1.0, 0.7):
        tokens, _ = sample_rows(logits, torch.full((64,), temperature), u)
        want = inverse_cdf_sample(torch.softmax(logits / temperature, -1), u)
        assert int((tokens == want).sum()) >= 63


def _sampler(params: list[SamplingParams]) -> RowSampler:
    return RowSampler.of(params, [torch.Generator().manual_seed(i) for i in range(len(params))])


def test_which_batches_draw_from_the_logits():
    t1, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    assert _sampler([t1, greedy]).draws_from_logits
    assert _sampler([t1, SamplingParams(temperature=0.7, top_k=20)]).draws_from_logits
    assert not _sampler([greedy, greedy]).draws_from_logits  # greedy batches keep their argmax step
    for other in (SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0, top_p=0.9),
                  SamplingParams(temperature=1.0, min_p=0.1),
                  SamplingParams(temperature=1.0, presence_penalty=0.5)):
        sampler = _sampler([t1, other])
        if other.seed is not None:  # a seeded row reads its position's uniform from its stream
            sampler.streams = [None, torch.rand(64)]
        assert not sampler.draws_from_logits, other


def test_greedy_rows_of_a_mixed_batch_take_their_argmax():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    sampler = _sampler([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2)
    tokens, log_normaliser = sampler.draw(logits, torch.rand(4))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    torch.testing.assert_close(log_normaliser, torch.logsumexp(logits, -1))  # T = 1 here, and 1 for greedy rows


def test_a_plain_sampled_step_follows_the_targets_law(tiny_dir, monkeypatch):
    """verify() without drafts on the tiny model, 48 identical rows a step (each its own generator): the tokens
    follow softmax(logits / T) of that position, and the step drew them in C (a spy on the kernel's calls)."""
    model = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, torch.quint4x2))
    rows, temperature = 48, 0.05  # low: the tiny random model's logits are flat at T = 1
    calls = []
    real = cpu_kernels.sample_rows
    monkeypatch.setattr(cpu_kernels, "sample_rows", lambda *a: calls.append(a[3]) or real(*a), raising=False)
    sampler = _sampler([SamplingParams(temperature=temperature)] * rows)
    pending, slots, start = torch.full((rows,), 17), torch.arange(rows), torch.full((rows,), 4)
    cache = model.new_cache(rows, 8)
    drawn = []
    with torch.inference_mode():
        prefix = torch.tensor([[3, 9, 40, 2]] * rows)
        model(prefix, slots, torch.zeros(rows, dtype=torch.long), cache)
        for _ in range(60):
            result = verify(model, cache, pending, slots, start, Draft.empty(rows), sampler)
            drawn.append(result.emitted[:, 0])
        law = torch.softmax(result.logits[0, 0].double() / temperature, -1)
    assert calls == [rows] * 60
    assert_follows(torch.cat(drawn), law, "plain sampled step")


def test_a_plain_step_at_temperature_1_hands_its_log_normaliser_to_the_log_probs(tiny_dir):
    """The draw's log sum exp(logits / T) is the log-probs' denominator where T = 1 without top_k (NaN for other
    rows: a top_k row's normaliser is over its k ids), and the log-probs a step returns from it equal those computed
    from the logits alone."""
    from specrl.engine.commit import token_logprobs

    model = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, torch.quint4x2))
    sampler = _sampler([SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=0.0),
                        SamplingParams(temperature=1.0, top_k=5)])
    pending, slots, start = torch.tensor([17, 5, 9, 40]), torch.arange(4), torch.full((4,), 3)
    cache = model.new_cache(4, 8)
    with torch.inference_mode():
        model(torch.tensor([[3, 9, 40]] * 4), slots, torch.zeros(4, dtype=torch.long), cache)
        result = verify(model, cache, pending, slots, start, Draft.empty(4), sampler)
    lse = torch.logsumexp(result.logits[:, 0], -1)
    assert torch.isnan(result.log_normaliser[1:, 0]).all()
    torch.testing.assert_close(result.log_normaliser[:1, 0], lse[:1], rtol=1e-6, atol=1e-5)
    assert int(result.emitted[3, 0]) in result.logits[3, 0].topk(5).indices.tolist()
    for row in (0,):
        token = result.emitted[row, :1].tolist()
        free = token_logprobs(result.logits[row, :1], token, 3, result.log_normaliser[row, :1])
        computed = token_logprobs(result.logits[row, :1], token, 3)
        want = torch.log_softmax(result.logits[row, 0], -1)
        assert abs(free[0][0] - computed[0][0]) < 1e-5 and abs(computed[0][0] - float(want[token[0]])) < 1e-5
        assert [i for i, _ in free[0][1]] == want.topk(3).indices.tolist()
