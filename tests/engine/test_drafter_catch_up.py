"""The drafter's catch-up before a batched propose: a row whose backlog of pending (feature, token)
entries passed CATCH_UP_ALONE (the suffix index drafted it meanwhile) catches up in a pass of its own
instead of padding the batch's pass to its length, and the drafts are the same either way."""

import pytest
import torch

from specrl.engine import engine as engine_module
from specrl.engine.engine import CATCH_UP_ALONE, _sampler
from specrl.engine.sequence import Status
from specrl.speculation.sampling import SamplingParams
from tests.engine.conftest import chat_prompts

PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@torch.inference_mode()
def drafts_after_a_skewed_backlog(make_engine, tokenizer):
    """Four rows decode plainly, rows 1-3 then have the drafter catch up (as when the head drafts
    them) and decode two more steps: row 0 waits with a backlog past CATCH_UP_ALONE, the others
    with 2 entries. -> (row 0's backlog, the batch's 3-token drafts)."""
    engine = make_engine(max_batch=4, suffix_capacity=0, fixed_draft_tokens=0)  # k = 0: entries pile up
    seqs = [engine.submit(p, PARAMS) for p in chat_prompts(tokenizer, 4)]
    while any(s.status is not Status.DECODE for s in seqs):
        engine.step()
    for _ in range(CATCH_UP_ALONE + 4):
        engine.step()
    engine._propose(seqs[1:], 1, _sampler(seqs[1:]))
    for _ in range(2):
        engine.step()
    backlog = len(seqs[0].draft_pending_tokens)
    draft = engine._propose(seqs, 3, _sampler(seqs))
    assert all(len(s.draft_pending_tokens) == 0 for s in seqs)  # every entry consumed
    return backlog, draft


def test_a_long_backlog_catches_up_alone_and_drafts_the_same(make_engine, tokenizer, monkeypatch):
    backlog, alone = drafts_after_a_skewed_backlog(make_engine, tokenizer)
    assert backlog > CATCH_UP_ALONE
    monkeypatch.setattr(engine_module, "CATCH_UP_ALONE", 10 ** 9)  # the whole batch padded to row 0's backlog
    _, padded = drafts_after_a_skewed_backlog(make_engine, tokenizer)
    assert torch.equal(alone.tokens, padded.tokens)
    assert torch.allclose(alone.logprobs, padded.logprobs, atol=1e-4)
