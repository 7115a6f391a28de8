"""Which weights a process starts on: the one place that resolves them.

A (re)started server, the vLLM backend and the drafter trainer all start on the weights store's
`current` versions when there are any, else on the base model and the drafter the settings name
(`settings.drafter`: "day0" = an untrained head built from the target, "none", or a drafter
directory). Without a store (`specrl generate`, benchmarks) only the settings count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrl.config import Settings
from specrl.weights import WeightsStore

DAY0 = "day0"
NO_DRAFTER = "none"


@dataclass(frozen=True)
class StartWeights:
    policy_dir: Path
    policy_version: str
    drafter: str  # DAY0, NO_DRAFTER, or a drafter directory
    drafter_version: str

    @property
    def has_drafter(self) -> bool:
        return self.drafter != NO_DRAFTER


def start_weights(settings: Settings, base_dir: Path, store: WeightsStore | None = None) -> StartWeights:
    """The store's current policy and drafter (verified against their manifests), else the settings'."""
    policy = store.current("policy") if store is not None else None
    policy_dir = store.verify("policy", policy) if policy else Path(base_dir)
    current = store.current("drafter") if store is not None and settings.drafter != NO_DRAFTER else None
    if current:
        drafter, drafter_version = str(store.verify("drafter", current)), current
    elif settings.drafter == NO_DRAFTER:
        drafter, drafter_version = NO_DRAFTER, NO_DRAFTER
    else:
        drafter, drafter_version = settings.drafter, settings.drafter_version
    return StartWeights(policy_dir, policy or settings.target_version, drafter, drafter_version)


def build_drafter(drafter: str, target, settings: Settings, vocabulary=None):
    """DAY0 / NO_DRAFTER / a directory -> an EagleDrafter sharing `target`'s embeddings, or None.
    vocabulary: a day-0 drafter's draft vocabulary (token ids; None: the first draft_vocab_size ids)."""
    from specrl.models.drafter import EagleDrafter

    if drafter == NO_DRAFTER:
        return None
    if drafter == DAY0:
        return EagleDrafter.day0(target, seed=settings.seed, draft_vocab_size=settings.draft_vocab_size,
                                 vocabulary=vocabulary)
    return EagleDrafter.load(Path(drafter), target)
