"""Weight swaps: what the engine is asked to swap, and how it is loaded off the decode path.

A swap is loaded and checked completely before the engine sees it (`load_swap`, run on a
worker thread): sha256 against the store's manifest, tensor names, shapes and dtype against
the serving model, architecture of the config. A failure there raises and changes nothing.
The engine then applies it between two steps (`Engine._apply_swap`) by swapping references:

- drafter: immediate; outputs cannot change, only speed.
- policy, mode "drain": requests already running finish on the old weights (both models stay
  in memory until the last of them ends); new requests start on the new ones.
- policy, mode "interrupt": every running request moves to the new weights now; its KV cache is
  recomputed from its tokens under the new weights, and its per-token versions record the switch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from specrl.errors import SwapError
from specrl.weights.store import ROLES

MODES = ("drain", "interrupt")


@dataclass
class SwapRequest:
    role: str
    version: str
    mode: str
    model: object  # a loaded, checked Llama (policy) or EagleDrafter (drafter)
    load_ms: float
    done: Future = field(default_factory=Future)  # -> SwapResult once applied at a step boundary
    requested_at: float = field(default_factory=time.perf_counter)


@dataclass
class SwapResult:
    role: str
    version: str
    mode: str
    load_ms: float
    swap_ms: float  # from the request reaching the engine to the swap taking effect


def check_swap(role: str, mode: str) -> None:
    """SwapError naming what is wrong with a swap's role or (policy) mode: the one check, both backends."""
    if role not in ROLES:
        raise SwapError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "policy" and mode not in MODES:
        raise SwapError(f"mode must be one of {', '.join(MODES)} for a policy swap, got {mode!r}")


def load_swap(role: str, version: str, mode: str, directory: Path, serving_target, plan=None) -> SwapRequest:
    """Build and check the new model from a verified store directory (worker thread); `plan`: the
    serving models' calibration (specrl.models.calibration), which packs the new weights the same way."""
    import torch
    from safetensors import SafetensorError

    from specrl.models.drafter import EagleDrafter
    from specrl.models.llama import LlamaConfig, WeightsMismatch, load_llama

    check_swap(role, mode)
    started = time.perf_counter()
    try:
        if role == "drafter":
            model = EagleDrafter.load(directory, serving_target)
            # EagleDrafter.load checks names and shapes only: a diverged trainer's NaN drafter swapped in and
            # every draft was rejected (measured: 0 of 132 accepted), a silent slowdown. load_llama checks a
            # policy's values; the vLLM worker checks both.
            for name, value in model.state_dict().items():
                if value.is_floating_point() and not torch.isfinite(value).all():
                    raise SwapError(f"drafter {version}: tensor {name} has NaN or inf values")
            if plan is not None:  # after the check: a prepared drafter's state_dict no longer holds its packed weights
                model.prepare_inference(plan)
        else:
            new_cfg = LlamaConfig.from_dir(directory)
            if new_cfg != serving_target.cfg:
                raise SwapError(f"policy {version}: its architecture ({new_cfg}) differs from the serving target's")
            model = load_llama(directory, plan=plan)
    except WeightsMismatch as exc:
        raise SwapError(f"{role} {version}: {exc}") from None
    except (OSError, ValueError, SafetensorError) as exc:  # unreadable or truncated safetensors
        raise SwapError(f"{role} {version}: cannot load the checkpoint ({exc})") from None
    return SwapRequest(role, version, mode, model, (time.perf_counter() - started) * 1000)
