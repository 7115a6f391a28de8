"""SamplingParams validation and per-row sampling rules (specrl/spec/sampling.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specrl.errors import InvalidRequestError
from specrl.spec.sampling import RowSampler, SamplingParams, top_p_filter


# ---- SamplingParams.check ----------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", None),
    ("temperature", -0.01), ("temperature", 2.01), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1.0"),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", math.nan), ("top_p", None),
    ("stop", ("ok", "")),
])
def test_check_rejects_bad_fields(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value}).check()
    assert err.value.param == field
    assert err.value.http_status == 400
    assert err.value.message  # a message a person can act on


@pytest.mark.parametrize("kwargs", [
    {}, {"max_tokens": 1}, {"temperature": 0.0}, {"temperature": 0}, {"temperature": 2.0}, {"top_p": 1.0},
    {"top_p": 1e-6}, {"stop": ("\n", "END")}, {"seed": 7, "stop_token_ids": (2,), "ignore_eos": True},
])
def test_check_accepts_valid_params(kwargs):
    SamplingParams(**kwargs).check()


def test_check_names_the_first_bad_field():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=0, temperature=5.0).check()
    assert err.value.param == "max_tokens"


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


# ---- RowSampler --------------------------------------------------------------------------------

def _sampler(params: list[SamplingParams], seeds: list[int] | None = None) -> RowSampler:
    seeds = seeds if seeds is not None else list(range(len(params)))
    return RowSampler.of(params, [torch.Generator().manual_seed(s) for s in seeds])


def test_of_maps_params_to_row_tensors():
    s = _sampler([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9)])
    assert s.temperature.dtype == torch.float32 and s.top_p.dtype == torch.float32
    assert s.greedy.tolist() == [True, False]
    assert torch.allclose(s.temperature, torch.tensor([0.0, 0.7]))
    assert torch.allclose(s.top_p, torch.tensor([1.0, 0.9]))
    assert not s.all_greedy
    assert _sampler([SamplingParams(temperature=0.0)] * 3).all_greedy


def test_probs_applies_temperature_per_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g) * 2
    s = _sampler([SamplingParams(temperature=0.5), SamplingParams(temperature=1.7), SamplingParams(temperature=0.0)])
    probs = s.probs(logits)
    assert probs.shape == (3, 4, 11) and probs.dtype == torch.float32
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.5, -1), atol=1e-6)
    assert torch.allclose(probs[1], torch.softmax(logits[1] / 1.7, -1), atol=1e-6)
    # Greedy rows get temperature 1: finite, same argmax, the plain softmax.
    assert torch.allclose(probs[2], torch.softmax(logits[2], -1), atol=1e-6)
    assert torch.equal(probs[2].argmax(-1), logits[2].argmax(-1))
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4), atol=1e-5)


def test_probs_without_top_p_is_plain_softmax():
    logits = torch.randn(2, 1, 9)
    s = _sampler([SamplingParams(), SamplingParams(temperature=1.0)])
    assert torch.allclose(s.probs(logits), torch.softmax(logits, -1), atol=1e-7)


def _reference_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    n = int(np.searchsorted(cum, top_p - 1e-12)) + 1  # first prefix with mass >= top_p
    kept = np.zeros_like(p)
    kept[order[:n]] = p[order[:n]]
    return kept / kept.sum()


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[[0.1, 0.4, 0.2, 0.3]]] * 5)  # shuffled vocabulary order
    top_p = torch.tensor([0.05, 0.39, 0.65, 0.75, 0.95])
    out = top_p_filter(probs, top_p)
    assert torch.allclose(out[0, 0], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # the most likely token is always kept
    assert torch.allclose(out[1, 0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(out[2, 0], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.allclose(out[3, 0], torch.tensor([0.0, 4 / 9, 2 / 9, 3 / 9]))
    assert torch.allclose(out[4, 0], probs[4, 0])


def test_top_p_matches_reference_on_random_rows():
    g = torch.Generator().manual_seed(2)  # a seed whose top_p values sit >= 1e-4 from every cumulative mass
    bsz, t, v = 16, 3, 20
    logits = torch.randn(bsz, t, v, generator=g) * 2
    top_p = torch.rand(bsz, generator=g) * 0.9 + 0.05
    params = [SamplingParams(temperature=0.8, top_p=float(tp)) for tp in top_p]
    s = _sampler(params)
    out = s.probs(logits).double().numpy()
    base = torch.softmax(logits / 0.8, -1).double().numpy()
    for b in range(bsz):
        for i in range(t):
            cum = np.sort(base[b, i])[::-1].cumsum()
            assert np.abs(cum - float(s.top_p[b])).min() > 1e-4, "test case sits on a boundary; pick another seed"
            ref = _reference_top_p(base[b, i], float(s.top_p[b]))
            np.testing.assert_array_equal(out[b, i] > 0, ref > 0, err_msg=f"row {b} position {i}")
            np.testing.assert_allclose(out[b, i], ref, atol=1e-6)


def test_top_p_one_row_does_not_depend_on_batch_mates():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 1, 512, generator=g) * 8  # peaked, like a real LM's next-token logits
    alone = _sampler([SamplingParams(top_p=1.0), SamplingParams(top_p=1.0)]).probs(logits)
    mixed = _sampler([SamplingParams(top_p=1.0), SamplingParams(top_p=0.9)]).probs(logits)
    assert bool((alone[0] > 0).all())
    assert bool((mixed[0] > 0).all()), f"top_p=1 row lost {int((mixed[0] == 0).sum())} of 512 tokens"
    assert torch.equal(alone[0], mixed[0])


def test_uniforms_row_b_comes_from_generator_b():
    params = [SamplingParams()] * 3
    u = _sampler(params, seeds=[10, 11, 12]).uniforms(5)
    assert u.shape == (3, 5) and u.dtype == torch.float32
    assert bool(((u >= 0) & (u < 1)).all())
    for b, seed in enumerate([10, 11, 12]):
        assert torch.equal(u[b], torch.rand(5, generator=torch.Generator().manual_seed(seed)))


def test_uniforms_of_a_row_do_not_depend_on_other_rows():
    alone = _sampler([SamplingParams()], seeds=[42])
    together = _sampler([SamplingParams()] * 3, seeds=[7, 42, 9])
    swapped = _sampler([SamplingParams()] * 2, seeds=[42, 1234])
    for n in (1, 4, 2):  # successive draws keep each row's stream its own
        a, t, s = alone.uniforms(n), together.uniforms(n), swapped.uniforms(n)
        assert torch.equal(a[0], t[1])
        assert torch.equal(a[0], s[0])
    assert not torch.equal(together.uniforms(3)[0], together.uniforms(3)[0])  # the stream advances
