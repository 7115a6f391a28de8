"""Which weights a process starts on: the one place that resolves them.

A (re)started server, the vLLM backend and the drafter trainer all start on the weights store's
`current` versions when there are any, else on the base model and the drafter the settings name
(`settings.drafter`: "pretrained" = the head shipped for the model, "day0" = an untrained head built
from the target, "none", or a drafter directory). Without a store (`specrl generate`, benchmarks)
only the settings count.

A shipped head (`specrl/drafters/<model alias>/`, written by `specrl pretrain-drafter`) is checked
against the sha256 its PRETRAINED_MANIFEST records before anything loads it, and serves as version
"pretrained-<first 12 hex digits>"; a model without one starts from day0, as before.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specrl.config import Settings
from specrl.errors import IncompatibleDrafterError
from specrl.weights import WeightsStore

DAY0 = "day0"
PRETRAINED = "pretrained"
NO_DRAFTER = "none"
SHIPPED_DRAFTERS = Path(__file__).resolve().parents[1] / "drafters"  # <alias>/: drafter.json, .safetensors, manifest
PRETRAINED_MANIFEST = "pretrained.json"  # the command, its minutes and curve, and the weights file's sha256


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
    elif settings.drafter == PRETRAINED:
        shipped = shipped_drafter(settings.model)
        if shipped is None:  # no head ships for this model
            drafter, drafter_version = DAY0, settings.drafter_version
        else:
            drafter, drafter_version = str(shipped), f"{PRETRAINED}-{verified_sha256(shipped)[:12]}"
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


def shipped_drafter(model: str) -> Path | None:
    """The directory of the head shipped for model alias `model`, or None when none ships (a model directory
    is no alias)."""
    if not model or Path(model).name != model:
        return None
    directory = SHIPPED_DRAFTERS / model
    return directory if (directory / PRETRAINED_MANIFEST).is_file() else None


def verified_sha256(directory: Path) -> str:
    """The sha256 of a shipped head's weights file, after checking it against its manifest's
    (IncompatibleDrafterError, naming the file, when it differs or the manifest is unreadable)."""
    try:
        manifest = json.loads((directory / PRETRAINED_MANIFEST).read_text())
        want, name = manifest["sha256"], manifest["weights_file"]
        digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IncompatibleDrafterError(f"the shipped drafter in {directory} is unreadable: {exc}") from None
    if digest != want:
        raise IncompatibleDrafterError(f"{directory / name} has sha256 {digest[:12]}..., its manifest says "
                                       f"{want[:12]}...: reinstall specrl or pass --drafter day0")
    return digest
