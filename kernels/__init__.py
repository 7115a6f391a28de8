"""Kernels, each beside its plain-torch twin (installed as `specrl.kernels`). Imports nothing of specrl.

Entry points (input checks, then Triton on CUDA when triton imports, else the twin):
- rejection_sample: speculative verification (verify.py / verify_triton.py);
- fused_drafter_loss: forward KL + negative term from hidden states and the head, chunked over the
  vocabulary, with autograd (drafter_loss.py / drafter_loss_triton.py).
Triton modules are imported only when a CUDA tensor needs them.
"""

from .dispatch import fused_drafter_loss, rejection_sample, triton_available
from .drafter_loss import drafter_loss_reference
from .verify import inverse_cdf_sample, rejection_sample_rowwise, rejection_sample_torch

__all__ = ["drafter_loss_reference", "fused_drafter_loss", "inverse_cdf_sample", "rejection_sample",
           "rejection_sample_rowwise", "rejection_sample_torch", "triton_available"]
