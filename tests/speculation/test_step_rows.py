"""A step's per-row lists (`Draft.rows`, `Verification.rows`): what the engine commits row by row."""

from __future__ import annotations

import torch

from specrl.speculation.propose import Draft
from specrl.speculation.verify import Verification


def test_draft_rows_cut_each_row_to_its_length():
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    logprobs = torch.tensor([[-0.5, -1.0, -1.5], [0.0, 0.0, 0.0], [-2.0, -2.5, -3.0]])
    rows = Draft(tokens, None, logprobs, torch.tensor([2, 0, 3])).rows()
    assert rows == [([5, 6], [-0.5, -1.0]), ([], []), ([11, 12, 13], [-2.0, -2.5, -3.0])]
    assert Draft(tokens, None, logprobs).rows()[1] == ([8, 9, 10], [0.0, 0.0, 0.0])  # no lengths: all K
    assert Draft.empty(2).rows() == [([], []), ([], [])]


def test_verification_rows_emit_the_accepted_drafts_and_one_token():
    emitted = torch.tensor([[4, 9, -1], [7, -1, -1], [1, 2, 3]])
    result = Verification(torch.tensor([1, 0, 2]), emitted, torch.zeros(3, 3, 2), torch.zeros(3, 3, 5))
    assert result.rows() == ([1, 0, 2], [[4, 9], [7], [1, 2, 3]])
