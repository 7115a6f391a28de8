"""Kernels, each beside its plain-torch twin (installed as `specrl.kernels`). Imports nothing of specrl."""

from .verify import inverse_cdf_sample, rejection_sample

__all__ = ["inverse_cdf_sample", "rejection_sample"]
