"""The weight versions `bench serve` and the swap-under-load test swap between, published into a
weights store before the server starts: two day-0 drafters and two policies (the model itself and a
perturbed copy, so that a policy swap changes the weights)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

DRAFTERS = ("drafter-s1", "drafter-s2")  # EagleDrafter.day0 with seeds 1 and 2
POLICIES = ("policy-perturbed", "policy-base")  # the first swap changes the weights


def prepare_versions(store_root: Path | str, model_dir: Path | str, *, noise: float = 0.05) -> dict[str, list[str]]:
    """Publish two day-0 drafters and two policies (the model's files, and a copy with every
    tensor perturbed by `noise` x its standard deviation); versions already in the store are
    reused. -> {"drafter": [...], "policy": [...]} (version names)."""
    from specrl.models.drafter import EagleDrafter
    from specrl.models.llama import load_llama
    from specrl.weights import WeightsStore

    store, model_dir = WeightsStore(store_root), Path(model_dir)
    have = {role: {m.version for m in store.versions(role)} for role in ("drafter", "policy")}
    with tempfile.TemporaryDirectory(prefix="specrl-swaps-") as tmp:
        missing = [(seed, name) for seed, name in enumerate(DRAFTERS, start=1) if name not in have["drafter"]]
        if missing:
            target = load_llama(model_dir)
            for seed, name in missing:
                EagleDrafter.day0(target, seed=seed).save(Path(tmp) / name)
                _publish(store, "drafter", Path(tmp) / name, name)
            del target
        base, perturbed = POLICIES[1], POLICIES[0]
        if base not in have["policy"]:
            _publish(store, "policy", model_dir, base)
        if perturbed not in have["policy"]:
            _perturbed_copy(model_dir, Path(tmp) / perturbed, noise)
            _publish(store, "policy", Path(tmp) / perturbed, perturbed, parent=base)
    return {"drafter": list(DRAFTERS), "policy": list(POLICIES)}


def _publish(store, role: str, source: Path, version: str, parent: str | None = None) -> None:
    from specrl.weights.store import WeightsConflictError

    try:
        store.publish(role, source, version=version, parent=parent)
    except WeightsConflictError:
        pass  # a concurrent preparer published it first: reuse


def _perturbed_copy(model_dir: Path, out: Path, noise: float) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(3)
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            for name, v in tensors.items():
                if v.is_floating_point() and v.numel() > 1:
                    scale = noise * v.float().std().item()
                    tensors[name] = (v.float() + scale * torch.randn(v.shape, generator=gen)).to(v.dtype)
            save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file() and f.name != "manifest.json":
            shutil.copy(f, out / f.name)


