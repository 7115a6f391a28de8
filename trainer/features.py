"""The target, as much of it as the trainer needs, and where an example's features come from.

`TargetPool` holds two kinds of target copy per policy version ("base" is the model directory):
- the head (`load_llama_head`: embeddings, final norm, output head, top layer), always: the
  drafter reads the embeddings and the norm, the distillation target is the head's logits, a
  day-0 drafter starts from the top layer;
- the whole model, only to recompute features (`recompute` on) and only once a record needs it.

`Features.of(example)`, in order: the features the records shipped (float16, completed by the
`ContextBook` from earlier segments or a context with the same prefix); else the shipped ones
with the positions before them recomputed; else all recomputed; else None (no target to run).
Every position the trainer's target computes is counted (`recomputed_tokens`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specrl.models.drafter import EagleDrafter
from specrl.models.llama import Llama, load_llama, load_llama_head
from specrl.trainer.contexts import ContextBook, Example
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.trainer")


class TargetPool:
    """Frozen target copies by policy version: heads always, whole models when allowed and needed."""

    def __init__(self, base_dir: Path, base_version: str, store: WeightsStore, *, recompute: bool = True):
        self.base_dir, self.base_version, self.store, self.recompute = base_dir, base_version, store, recompute
        self._heads: dict[str, Llama] = {}
        self._full: dict[str, Llama] = {}
        self._head_rows: tuple[str | None, torch.Tensor | None] = (None, None)

    def _load(self, kind: dict[str, Llama], version: str, loader) -> Llama | None:
        """The newest two versions of a kind are kept."""
        if version not in kind:
            try:
                directory = self.base_dir if version == self.base_version else self.store.verify("policy", version)
                model = loader(directory)
            except Exception as exc:  # noqa: BLE001 - any unloadable version is skipped, with the reason logged
                log.warning("event=target_unavailable version=%s error=%s", version, exc)
                return None
            last = dict(list(kind.items())[-1:])
            kind.clear()
            kind.update({version: model, **last})
        return kind[version]

    def head(self, version: str) -> Llama | None:
        """The target's head at `version` (None: it cannot be loaded)."""
        return self._load(self._heads, version, load_llama_head)

    def full(self, version: str) -> Llama | None:
        """The whole target at `version`, loaded on first use; None when recompute is off or it cannot be loaded."""
        if not self.recompute:
            return None
        if version not in self._full:
            log.info("event=target_load version=%s reason=features_to_recompute", version)
        return self._load(self._full, version, load_llama)

    @property
    def loaded_full(self) -> list[str]:
        """Versions whose whole model is in memory."""
        return list(self._full)

    @torch.no_grad()
    def draft_logits(self, version: str, hidden: torch.Tensor, drafter: EagleDrafter) -> torch.Tensor:
        """hidden [N, H] of the target at `version` -> its logits over the drafter's vocabulary
        [N, V_d]: a reduced draft vocabulary needs only those rows of the head."""
        target = self.head(version)
        if self._head_rows[0] != version:  # the rows are copied once per target version
            self._head_rows = (version, drafter.head_rows(target.lm_head))
        return target.logits(hidden, self._head_rows[1])

    @torch.no_grad()
    def features(self, version: str, tokens: list[int]) -> torch.Tensor | None:
        """-> hidden [T, H] float32 of the whole target at `version` over `tokens` (None: no target).
        No logits: the caller takes them (`draft_logits`) only at the positions it trains."""
        target = self.full(version)
        return None if target is None else target(torch.tensor(tokens)[None])[0]


class Features:
    """An example's target features [T-1, H] float32 (positions 0..T-2, all the drafter reads)."""

    def __init__(self, pool: TargetPool, book: ContextBook):
        self.pool, self.book = pool, book
        self.shipped = 0  # examples trained or held out on the records' features alone
        self.recomputed = 0  # examples whose features the trainer computed (all or the positions before the shipped)
        self.recomputed_tokens = 0  # positions the trainer's target computed

    def of(self, example: Example) -> torch.Tensor | None:
        if example.complete or self.book.fill(example):
            self.shipped += 1
            return example.features.float()
        if example.features is not None:  # shipped from feature_start on: compute only what comes before
            gap = self.pool.features(example.target_version, example.tokens[: example.feature_start])
            if gap is None:
                return None
            features = torch.cat([gap, example.features.float()])
            self.recomputed_tokens += example.feature_start
            self.book.remember(example.request_id, example.target_version, example.tokens, features.half())
        else:
            hidden = self.pool.features(example.target_version, example.tokens)
            if hidden is None:
                return None
            features = hidden[:-1]
            self.recomputed_tokens += len(example.tokens)
        self.recomputed += 1
        return features
