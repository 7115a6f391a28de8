"""EAGLE-style drafter head.

One decoder layer over fc([embed(next token) ; target hidden / scale]), sharing the target's
frozen embeddings and final norm. Its output is a predicted next hidden state: through the
norm and an output head it gives draft logits, and it is the feature for the next draft step.
The output head is either the target's own lm_head (full vocabulary) or a reduced draft
vocabulary [V_d, H] with a token map `draft_to_target` [V_d] int64 (the full 49k head is most of
a small drafter's cost: measured on SmolLM2 on an early, slower build, a pass took 28.5 ms with the
full head, 5.4 ms with an 8k one; `specrl bench engine` prints today's pass beside a target step).

Features are divided per dimension by `feature_scale` (target hidden states have outlier
dimensions with RMS in the hundreds); a scale, not a shift, so it folds into `fc` on export.

Positions: drafter index j holds (target hidden at position j, token at position j+1); its
output predicts the token at position j+2. The drafter keeps its own one-layer KV cache.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specrl.errors import IncompatibleDrafterError
from specrl.models.kv_cache import CacheBatch, KVCache
from specrl.models.linear import PackedLinear, linear, plain_weight
from specrl.models.llama import DecoderLayer, Llama, LlamaConfig, Rope, _set_weight, rms_norm

if TYPE_CHECKING:
    from specrl.models.calibration import Calibration

ARCHITECTURE = "eagle1-llama"
CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"
# The weights file's "format" metadata for a compact copy (a head shipped in the repository): every 2-D weight
# as int8 rows, each with a float32 scale (its largest |value| / 127) under the weight's name + SCALE_SUFFIX; the
# rest as saved. Half of bfloat16's bytes (SmolLM2's 8k head: ~9 MB against ~18), a rounding of ~0.4% of a row's
# largest value, which the serving formats round again (int8 and q4 per group of 32).
INT8_ROWS = "int8-rows"
SCALE_SUFFIX = ".scale"


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # == vocab_size: the target's head is used
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    architecture: str = ARCHITECTURE

    @classmethod
    def for_target(cls, target: LlamaConfig, draft_vocab_size: int | None = None) -> "DrafterConfig":
        return cls(target.hidden_size, target.vocab_size, draft_vocab_size or target.vocab_size, target.num_heads,
                   target.num_kv_heads, target.head_dim, target.intermediate_size, target.rms_norm_eps,
                   target.rope_theta, target.max_position_embeddings)

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(self.vocab_size, self.hidden_size, self.intermediate_size, 1, self.num_heads,
                           self.num_kv_heads, self.head_dim, self.rms_norm_eps, self.rope_theta,
                           self.max_position_embeddings, tie_word_embeddings=False)

    def check_fits(self, target: LlamaConfig) -> None:
        """Raise IncompatibleDrafterError naming the first field that does not fit the target."""
        if self.architecture != ARCHITECTURE:
            raise IncompatibleDrafterError(f"drafter architecture {self.architecture!r} is not {ARCHITECTURE!r}")
        for name, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
            if getattr(self, name) != want:
                raise IncompatibleDrafterError(
                    f"drafter {name}={getattr(self, name)} does not fit the target's {name}={want}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise IncompatibleDrafterError(f"draft_vocab_size={self.draft_vocab_size} must be in 1..{self.vocab_size}")


class EagleDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target: Llama):
        super().__init__()
        cfg.check_fits(target.cfg)
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Parameter(torch.empty(h, 2 * h))
        # With its input norm: measured on SmolLM2, dropping it (vLLM's EAGLE-1 layout) left the
        # forward KL ~2x higher after the same training (the residual stream must carry the raw
        # hidden scale into the frozen final norm). Export to vLLM must fold or keep this norm.
        self.layer = DecoderLayer(cfg.layer_config())
        self.register_buffer("feature_scale", torch.ones(h))
        reduced = cfg.draft_vocab_size < cfg.vocab_size
        self.head = nn.Parameter(torch.empty(cfg.draft_vocab_size, h)) if reduced else None
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size) if reduced else None)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self._target = (target,)  # shared, frozen, not a submodule: not saved, not trained
        self.prepared = False

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.post_norm.dtype

    def prepare_inference(self, plan: "Calibration") -> "EagleDrafter":
        """Pack fc, the layer's linears and a reduced head as `plan` chose, in plan.dtype (the
        target's: prepare it with the same plan). Inference only, like Llama.prepare_inference;
        `save`, `state_dict` and training are for the plain form."""
        if self.prepared:
            raise ValueError("this drafter is already prepared for inference")
        if self.target.dtype != plan.dtype:
            raise IncompatibleDrafterError(f"the drafter is prepared in {plan.dtype}, its target runs in {self.target.dtype}")
        with torch.no_grad():
            _set_weight(self, "fc", plan.pack(self.fc))
            self.layer.prepare_inference(plan)
            if self.head is not None:
                _set_weight(self, "head", plan.pack(self.head, head=True))
        self.rope.to(plan.dtype)
        self.prepared = True
        return self

    @property
    def target(self) -> Llama:
        return self._target[0]

    def retarget(self, target: Llama) -> None:
        """Share a new policy's embeddings, norm and head (after a policy swap)."""
        if (target.cfg.hidden_size, target.cfg.vocab_size) != (self.cfg.hidden_size, self.cfg.vocab_size):
            raise IncompatibleDrafterError("the new target's hidden size or vocabulary does not fit the drafter")
        self._target = (target,)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(1, num_slots, max_len, self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, slots: torch.Tensor | None = None,
                start: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """features [B, T, H] float32 (target hidden, or the drafter's own output), next_tokens [B, T]
        int64 -> predicted hidden [B, T, H] float32. With a cache, row b sits at drafter positions
        start[b]..start[b]+T-1 of slot slots[b]; without one, positions 0..T-1, causal (training)."""
        emb = self.target.embed_tokens(next_tokens)
        x = linear(torch.cat([emb, (features / self.feature_scale).to(emb.dtype)], dim=-1), self.fc)
        if cache is None:
            positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
            cos, sin = self.rope.tables(positions)
            return self.layer(x, cos, sin, None)
        batch = CacheBatch(cache, slots, start, x.shape[1])
        cos, sin = self.rope.tables(batch.positions)
        return self.layer(x, cos, sin, batch).float()

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, batch: CacheBatch) -> torch.Tensor:
        """One further draft pass: hidden [B, H] float32 (the drafter's own last output), tokens [B] int64
        (the token just drafted from it) at batch.positions [B, 1] -> predicted hidden [B, H] float32.
        `forward` at T = 1 to the bit, for the passes of a drafting loop: the caller builds the batch once
        and advances it (`CacheBatch.advance`), and the layer is called without nn.Module's dispatch (the
        two took ~40 of a ~400 us pass at B = 1, q4)."""
        emb = self.target.embed_tokens(tokens)
        x = linear(torch.cat([emb, (hidden / self.feature_scale).to(emb.dtype)], dim=-1), self.fc)
        cos, sin = self.rope.tables(batch.positions)
        return self.layer.forward(x[:, None], cos, sin, batch)[:, 0].float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> draft logits [..., V_d] float32 (over the draft vocabulary)."""
        return linear(self.head_input(hidden), self.head_weight()).float()

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> the output head's input [..., H]: the target's final norm of it."""
        return rms_norm(hidden.to(self.dtype), self.target.norm, self.cfg.rms_norm_eps)

    def head_weight(self) -> "torch.Tensor | PackedLinear":
        """The output head [V_d, H]: the reduced draft head, or the target's lm_head (packed once prepared)."""
        return self.target.lm_head if self.head is None else self.head

    @torch.no_grad()
    def set_feature_scale(self, scale: torch.Tensor) -> None:
        """Standardise the feature input by `scale` [H] without changing what the drafter computes:
        fc's feature columns absorb the scale (fc(h / s) with W diag(s) is W h)."""
        h = self.cfg.hidden_size
        self.fc[:, h:] *= (scale / self.feature_scale)[None, :]
        self.feature_scale.copy_(scale)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """target_ids [N] int64 -> draft ids [N] int64, -1 where a token is outside the draft vocabulary."""
        if self.draft_to_target is None:
            return target_ids
        index = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long)
        index[self.draft_to_target] = torch.arange(self.cfg.draft_vocab_size)
        return index[target_ids]

    def head_rows(self, head: torch.Tensor) -> torch.Tensor:
        """A full-vocabulary head [V, H] -> its rows for the draft vocabulary [V_d, H]."""
        head = plain_weight(head) if isinstance(head, PackedLinear) else head
        return head if self.draft_to_target is None else head[self.draft_to_target]

    # ---- construction and files ----------------------------------------------------------
    @classmethod
    def day0(cls, target: Llama, seed: int = 0, draft_vocab_size: int = 0,
             vocabulary: torch.Tensor | None = None) -> "EagleDrafter":
        """An untrained head: its layer starts from the target's top layer (a better start than
        noise: untrained truncated drafters accepted ~0.05 tokens per k=4 step), fc passes the feature through and adds a little of the embedding.

        draft_vocab_size 0 (or >= the target's) uses the target's head. Otherwise the draft
        vocabulary is the first `draft_vocab_size` token ids, with the target's head rows: a BPE
        vocabulary numbers its merges in the order they were learned, most frequent first
        (on SmolLM2, ids below 8192 are 90% of the tokens it generates on the bundled prompts).
        vocabulary [V_d] int64 (distinct target ids, e.g. `frequency_vocabulary`'s) names the draft
        vocabulary instead of the first ids; draft_vocab_size is then ignored."""
        if draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0: the full vocabulary), got {draft_vocab_size}")
        if vocabulary is not None:
            _check_vocabulary(vocabulary, target.cfg.vocab_size)
            draft_vocab_size = len(vocabulary)
        reduced = 0 < draft_vocab_size < target.cfg.vocab_size
        drafter = cls(DrafterConfig.for_target(target.cfg, draft_vocab_size if reduced else None), target)
        if reduced and vocabulary is not None:
            drafter.draft_to_target.copy_(vocabulary)
        gen = torch.Generator().manual_seed(seed)
        h = target.cfg.hidden_size
        top = target.layers[-1]
        with torch.no_grad():
            fc = torch.randn(h, 2 * h, generator=gen) * (0.02 / h ** 0.5)
            fc[:, h:] += torch.eye(h)
            drafter.fc.copy_(fc)
            for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down"):
                getattr(drafter.layer, name).copy_(plain_weight(getattr(top, name)))
            if reduced:
                drafter.head.copy_(target.head_rows(drafter.draft_to_target))
        return drafter

    def save(self, directory: Path, int8_rows: bool = False) -> None:
        """Write drafter.json and drafter.safetensors (int8_rows: the compact INT8_ROWS copy) into `directory`."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        metadata = None
        if int8_rows:
            tensors, metadata = _int8_rows(tensors), {"format": INT8_ROWS}
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata=metadata)
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.cfg), indent=2))

    @classmethod
    def load(cls, directory: Path, target: Llama) -> "EagleDrafter":
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise IncompatibleDrafterError(f"{directory} is not a drafter: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
        try:
            cfg = DrafterConfig(**json.loads((directory / CONFIG_FILE).read_text()))
        except (TypeError, ValueError) as exc:
            raise IncompatibleDrafterError(f"{directory / CONFIG_FILE} is not a drafter config: {exc}") from None
        drafter = cls(cfg, target)
        state = read_state(directory)
        own = drafter.state_dict()
        if set(state) != set(own):
            raise IncompatibleDrafterError(f"{directory / WEIGHTS_FILE} tensors {sorted(set(state) ^ set(own))[:3]} do not fit {ARCHITECTURE}")
        for name, value in state.items():
            if value.shape != own[name].shape:
                raise IncompatibleDrafterError(f"drafter tensor {name} has shape {tuple(value.shape)}, expected {tuple(own[name].shape)}")
        drafter.load_state_dict(state)
        return drafter


def read_state(directory: Path) -> dict[str, torch.Tensor]:
    """A drafter directory's weights file -> its tensors by state-dict name, an INT8_ROWS file's weights scaled
    back to float32 (IncompatibleDrafterError when the file is not a readable safetensors file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(Path(directory) / WEIGHTS_FILE), "pt") as f:
            tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise IncompatibleDrafterError(f"{Path(directory) / WEIGHTS_FILE} is not a drafter weights file: {exc}") from None
    if metadata.get("format") != INT8_ROWS:
        return tensors
    return {name: value.float() * tensors[name + SCALE_SUFFIX][:, None] if name + SCALE_SUFFIX in tensors else value
            for name, value in tensors.items() if not name.endswith(SCALE_SUFFIX)}


def _int8_rows(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2-D floating tensor -> int8 rows and their float32 scales (INT8_ROWS); the rest unchanged."""
    out = {}
    for name, value in tensors.items():
        if value.dim() != 2 or not value.is_floating_point():
            out[name] = value
            continue
        value = value.float()
        scale = value.abs().amax(1).clamp_min(1e-12) / 127
        out[name] = torch.round(value / scale[:, None]).clamp(-127, 127).to(torch.int8)
        out[name + SCALE_SUFFIX] = scale
    return out


def frequency_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """counts [V] (how often each token id occurred, e.g. in the target's own outputs) -> the `size`
    most frequent ids [size] int64, most frequent first; equal counts (unseen ids included) in id
    order, so a vocabulary larger than what was seen fills up with the first ids, as `day0`'s does."""
    if not 0 < size <= len(counts):
        raise ValueError(f"a draft vocabulary of {size} ids must be in 1..{len(counts)}")
    return torch.sort(-counts.long(), stable=True).indices[:size].clone()


def _check_vocabulary(vocabulary: torch.Tensor, vocab_size: int) -> None:
    if (vocabulary.dim() != 1 or len(vocabulary) == 0 or vocabulary.dtype != torch.long
            or int(vocabulary.min()) < 0 or int(vocabulary.max()) >= vocab_size
            or len(torch.unique(vocabulary)) != len(vocabulary)):
        raise ValueError(f"a draft vocabulary must be distinct int64 token ids in 0..{vocab_size - 1}")
