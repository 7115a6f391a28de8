"""Versioned checkpoint store: manifests, sha256, an atomic "current" pointer per role."""

from specrl.weights.store import (
    ROLES,
    CorruptWeightsError,
    Manifest,
    WeightsConflictError,
    WeightsError,
    WeightsNameError,
    WeightsNotFoundError,
    WeightsStore,
)

__all__ = [
    "ROLES",
    "CorruptWeightsError",
    "Manifest",
    "WeightsConflictError",
    "WeightsError",
    "WeightsNameError",
    "WeightsNotFoundError",
    "WeightsStore",
]
