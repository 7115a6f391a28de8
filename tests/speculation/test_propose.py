"""propose's greedy draft: the argmax and its log q in one C pass, against torch's."""

import pytest
import torch

from specrl.models.linear import cpu_kernels
from specrl.speculation.propose import argmax_logprob


def _torch_greedy(logits):
    ids = logits.argmax(-1)
    return ids, torch.log_softmax(logits, -1)[torch.arange(len(ids)), ids]


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("vocab", [1, 7, 31, 8192, 8195])
def test_argmax_logprob_is_torchs_argmax_and_log_softmax(vocab, portable):
    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen) * 8
    logits[1] = 0.0  # all tied: the first id, log q = -log V
    if vocab > 3:
        logits[2, [2, vocab - 1]] = 1e3  # a tie at the max far apart; every other id's weight underflows
    ids, logprobs = torch.empty(5, dtype=torch.long), torch.empty(5)
    cpu_kernels.argmax_logprob_rows(ids.data_ptr(), logprobs.data_ptr(), logits.data_ptr(), 5, vocab, portable)
    want_ids, want_logprobs = _torch_greedy(logits)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-5, rtol=1e-5)


def test_argmax_logprob_takes_torch_where_the_kernel_cannot():
    logits = torch.randn(6, 4, 50).transpose(0, 1)[0]  # not contiguous
    ids, logprobs = argmax_logprob(logits)
    want_ids, want_logprobs = _torch_greedy(logits)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs)
    ids, logprobs = argmax_logprob(logits.contiguous())
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-5, rtol=1e-5)
