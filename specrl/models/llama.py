"""A lean Llama forward in plain PyTorch (the target runtime).

One forward serves prefill chunks, batched decode and the multi-token verify: every row of
a batch feeds T new tokens at its own start position, reads its own KV slot and gets back
the last layer's hidden states (pre final norm: the drafter's features). Logits are
computed only for the rows asked for (`logits`), so a prefill never pays for the head over
the whole prompt.

Weights are plain tensors fused at load time (q|k|v, gate|up) and loaded by copying into
the existing tensors: the cheapest hot swap, and nothing is reallocated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specrl.errors import ModelNotFoundError
from specrl.models.kv_cache import CacheBatch, KVCache
from specrl.models.linear import linear


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        if hf.get("model_type", "llama") != "llama":
            raise ModelNotFoundError(f"model_type {hf.get('model_type')!r} is not supported: only llama")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ModelNotFoundError(f"rope_type {rope['rope_type']!r} is not supported: only default RoPE")
        eos = hf.get("eos_token_id")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "LlamaConfig":
        config = cls.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():  # the chat end token (<|im_end|>) is often only named here
            eos = json.loads(gen.read_text()).get("eos_token_id")
            extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
            config = LlamaConfig(**{**asdict(config), "eos_token_ids": tuple(dict.fromkeys([*config.eos_token_ids, *extra]))})
        return config


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Rope:
    """Rotary embedding tables [max_pos, D] computed once (HF's rotate-half convention)."""

    def __init__(self, head_dim: int, theta: float, max_pos: int):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, D] (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP. `input_norm=False` drops the first norm (EAGLE heads)."""

    def __init__(self, cfg: LlamaConfig, input_norm: bool = True):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = nn.Parameter(torch.ones(h)) if input_norm else None
        self.qkv = nn.Parameter(torch.empty((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h))
        self.o = nn.Parameter(torch.empty(h, cfg.num_heads * d))
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h))
        self.down = nn.Parameter(torch.empty(h, cfg.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None, batch: CacheBatch | None) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. With `cache` (this layer's [S, KVH, MAX, D] k and v) the new
        keys are written to the batch's slots and attention reads the slot's history; without,
        attention is causal over the T tokens alone (training)."""
        cfg = self.cfg
        residual = x
        if self.input_norm is not None:
            x = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        bsz, t, _ = x.shape
        q, k, v = linear(x, self.qkv).split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q = apply_rope(q.view(bsz, t, cfg.num_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(bsz, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2), cos, sin)
        v = v.view(bsz, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if cache is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            batch.write(cache[0], cache[1], k, v)
            keys, values = batch.read(cache[0], cache[1])
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
        x = residual + linear(attn.transpose(1, 2).reshape(bsz, t, -1), self.o)
        gate, up = linear(rms_norm(x, self.post_norm, cfg.rms_norm_eps), self.gate_up).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        # Tied embeddings share one tensor, so a swap that copies into `embed` updates the head too.
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.requires_grad_(False)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(self.cfg.num_layers, num_slots, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor | None = None, start: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens [B, T] int64 at positions start[b] .. start[b]+T-1 of slot slots[b] -> hidden [B, T, H]
        (the last layer's output before the final norm). Without a cache: whole sequences from
        position 0, causal (the trainer's feature pass; right padding does not leak backwards)."""
        x = F.embedding(tokens, self.embed)
        if cache is None:
            cos, sin = self.rope.tables(torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1))
            for layer in self.layers:
                x = layer(x, cos, sin, None, None)
            return x
        batch = CacheBatch.build(slots, start, tokens.shape[1])
        cos, sin = self.rope.tables(batch.positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, (cache.k[i], cache.v[i]), batch)
        return x

    def logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] float32; `head` [V', H]: rows of lm_head to use instead."""
        return linear(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps), self.lm_head if head is None else head)

    # ---- weights -------------------------------------------------------------------------
    def load_hf_state(self, source: "dict[str, torch.Tensor] | TensorSource") -> None:
        """Copy HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...) into this model,
        one tensor at a time (q, k, v land in slices of the fused qkv; gate, up in gate_up), so
        loading never holds a second copy of the weights.

        Names and shapes are all checked before anything is copied (WeightsMismatch names the
        first problem). Values are checked while copying; a non-finite tensor stops the load
        part-way, so load into a fresh model (hot swaps always do)."""
        source = source if isinstance(source, TensorSource) else TensorSource(source)
        params = dict(self.named_parameters(remove_duplicate=True))
        layout = hf_layout(self.cfg)
        for name, parts in layout.items():
            shapes = [source.shape(part) for part in parts]
            missing = [part for part, shape in zip(parts, shapes) if shape is None]
            if missing:
                raise WeightsMismatch(f"checkpoint has no tensor {missing[0]!r}")
            rows, want = sum(shape[0] for shape in shapes), tuple(params[name].shape)
            if any(shape[1:] != want[1:] for shape in shapes) or rows != want[0]:
                raise WeightsMismatch(f"{name}: checkpoint shapes {shapes} do not fit {want}")
        with torch.no_grad():
            for name, parts in layout.items():
                offset = 0
                for part in parts:
                    value = source.get(part)
                    if not value.dtype.is_floating_point or not torch.isfinite(value).all():
                        raise WeightsMismatch(f"{part}: not finite floating-point values")
                    params[name][offset: offset + value.shape[0]].copy_(value)
                    offset += value.shape[0]


    def hf_state(self) -> dict[str, torch.Tensor]:
        """This model's weights under HF Llama names (the inverse of `load_hf_state`)."""
        cfg, params = self.cfg, dict(self.named_parameters(remove_duplicate=True))
        qkv_rows = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        out = {}
        for name, parts in hf_layout(cfg).items():
            rows = qkv_rows if name.endswith(".qkv") else [params[name].shape[0] // len(parts)] * len(parts)
            for part, value in zip(parts, params[name].detach().split(rows)):
                out[part] = value.contiguous()
        return out


class TensorSource:
    """HF tensors by name, from a dict or lazily from safetensors files (shape without loading)."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, files: list[Path] | None = None):
        from safetensors import safe_open

        self._tensors = tensors or {}
        self._handles = {}
        for path in files or []:
            handle = safe_open(str(path), framework="pt")
            self._handles.update({key: handle for key in handle.keys()})

    @classmethod
    def from_dir(cls, model_dir: Path) -> "TensorSource":
        """Every *.safetensors file of an HF model directory."""
        return cls(files=sorted(Path(model_dir).glob("*.safetensors")))

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        if name in self._handles:
            return tuple(self._handles[name].get_slice(name).get_shape())
        return None

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name] if name in self._tensors else self._handles[name].get_tensor(name)


def hf_layout(cfg: LlamaConfig) -> dict[str, list[str]]:
    """This module's parameter -> the HF tensors concatenated (dim 0) to make it."""
    out = {"embed": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.input_norm"] = [p + "input_layernorm.weight"]
        out[f"layers.{i}.qkv"] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        out[f"layers.{i}.o"] = [p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.post_norm"] = [p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.gate_up"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        out[f"layers.{i}.down"] = [p + "mlp.down_proj.weight"]
    return out


class WeightsMismatch(ValueError):
    """A checkpoint whose tensors do not fit the model (names, shapes or values)."""


def load_llama(model_dir: Path) -> Llama:
    """Build the target from an HF safetensors directory (config.json + *.safetensors)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelNotFoundError(f"{model_dir} has no config.json")
    model = Llama(LlamaConfig.from_dir(model_dir))
    model.load_hf_state(TensorSource.from_dir(model_dir))
    return model
