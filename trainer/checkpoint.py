"""A trainer's checkpoint on disk, written so that a crash mid-write never leaves half a file."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_checkpoint(state: dict, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then an atomic rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
