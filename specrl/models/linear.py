"""The matmul call for a linear layer, picked by the number of rows.

On this CPU (FACTS.md, re-measured with torch 2.13 MKL, 2 threads, head [49152, 576]):
`F.linear` costs about the same for 1 to 8 rows, while `W @ x.T` on the [out, in] weight
costs 2.4 ms at 2 rows, 3.7 ms at 5 and 7.4 ms at 8 against 11-14 ms for `F.linear`. A
single row is slower through that call than two, so one row is padded to two.
Decode and verify forwards are all small-M: this is what makes a k-token verify cost
~1.5x one token instead of ~2x. Large M (prefill, training) goes through `F.linear`.

Rows go in and come out row-major (below). Measured on a later, slower machine (SmolLM2, 1
thread, B=1, context 120): a forward over T=1/2/3/5 positions cost 38/39/57/73 ms with that,
40/70/79/99 ms without it, when each result (a transposed view) reached the next layer as a
column-major input.
"""

import torch
import torch.nn.functional as F

SMALL_M = 16


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., IN] float32, weight [OUT, IN] float32 -> [..., OUT]."""
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_M or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight)
    # Row-major rows in and out: `W @ x2.t()` with x2 column-major (what a transposed result fed
    # back in would be) takes MKL's other path, measured 5x slower ([3072, 576] @ [576, 2]:
    # 62 vs 12 ms per 30 layers); it made every verify forward ~1.8x a one-token forward.
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:
        x2 = torch.cat([x2, x2])
    out = (weight @ x2.t()).t()[:rows].contiguous()
    return out.reshape(*x.shape[:-1], weight.shape[0])
