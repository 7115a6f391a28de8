"""A lean Llama forward in plain PyTorch (the target runtime).

One forward serves prefill chunks, batched decode and the multi-token verify: every row of
a batch feeds T new tokens at its own start position, reads its own KV slot and gets back
the last layer's hidden states (pre final norm: the drafter's features). Logits are
computed only for the rows asked for (`logits`), so a prefill never pays for the head over
the whole prompt.

Weights are plain tensors fused at load time (q|k|v, gate|up), read straight from the
safetensors files into the parameters. For serving, `load_llama(dir, plan)` then packs every
linear once as the start-up calibration chose for this CPU (`specrl.models.calibration`),
its weights in float32, float16, bfloat16, int8 or 4-bit and everything else in float32; a 4-bit model whose
directory holds its GGUF is served from the GGUF's blocks as they ship (`gguf_reader.load_gguf`). Training builds and
backpropagates through the plain form (which also runs in bfloat16 throughout).

A float32 step whose four linears all take the stream kernel runs each layer as one C call
(`DecoderLayer.forward_streamed`: norms, linears, fused attention, SwiGLU, residuals); otherwise the same kernels
are called op by op. A prompt chunk longer than one fused attention call (`kv_cache.FUSED_MAX_TOKENS`) runs as
consecutive forwards of that many tokens, so a position's bits do not depend on the chunking (`kv_cache.fuses`).

Left out, measured (AVX2 EPYC, 1 thread, SmolLM2, context 120): torch.compile (inductor CPU, dynamic shapes) of the
decoder layer. It cannot take oneDNN's opaque packed weights; with the linears left eager it compiled 6-12 s per
new (B, T) case, failed on a masked one, and ran 1.16x / 1.22x slower at B x T = 1x1 / 1x5 (five graphs a layer,
~35 us of guards and wrapper each); compiled pieces alone (residual+norm, silu*up, rope) took 38-54 us a call
against 7-17 us eager.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specrl.errors import ModelNotFoundError
from specrl.models.huge_pages import move_into_huge_pages
from specrl.models.kv_cache import FUSED_MAX_TOKENS, CacheBatch, KVCache, fuses
from specrl.models.linear import KIND, PackedLinear, cpu_kernels, linear, plain_weight
from specrl.models.quantize import Int8Weight, Q4Weight

if TYPE_CHECKING:
    from specrl.models.calibration import Calibration


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
    """x [..., H] -> [..., H]; bfloat16 is normalised in float32 and cast back (as HF does).
    Inference in float32 takes the fused C kernel (`_cpu_kernels.rms_norm`: one pass a row, against
    ~40 us of dispatch for torch's six ops at H = 576); `F.rms_norm` is no fused kernel on CPU
    (measured 10-15% slower than the six ops), and autograd needs the ops."""
    if x.dtype == torch.float32:
        if cpu_kernels is not None and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) \
                and weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous():
            out = torch.empty_like(x)
            cpu_kernels.rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // x.shape[-1],
                                 x.shape[-1], eps)
            return out
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] float32 (finite) -> [...] int64, the first index of each row's max, as torch's
    argmax gives it. The C kernel (`_cpu_kernels.argmax_rows`) reads a 49k row of logits in ~4 us
    against torch's 23-40 us (2 threads, AVX-512 EPYC): a greedy verify step takes one a position."""
    if cpu_kernels is not None and x.dtype == torch.float32 and x.is_contiguous() and x.numel():
        out = torch.empty(x.shape[:-1], dtype=torch.long)
        cpu_kernels.argmax_rows(out.data_ptr(), x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1])
        return out
    return x.argmax(-1)


def _kernel_input(x: torch.Tensor) -> bool:
    """Whether x can go into the C layer calls: float32 inference activations, contiguous."""
    return x.dtype == torch.float32 and not x.requires_grad and x.is_contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (the fused gate|up linear's output) -> silu(gate) * up [..., I]. Float32
    inference takes the C kernel (one pass, against chunk + silu + mul: 17 us for silu alone at
    5 rows of SmolLM2's 1536 on the AVX2 EPYC); autograd needs the ops."""
    if cpu_kernels is not None and gate_up.dtype == torch.float32 and not gate_up.requires_grad \
            and gate_up.is_contiguous():
        half = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], half)
        cpu_kernels.silu_mul(out.data_ptr(), gate_up.data_ptr(), gate_up.numel() // gate_up.shape[-1], half)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Rope:
    """Rotary embedding tables [max_pos, D] computed once (HF's rotate-half convention).

    `sin` carries rotate-half's sign (-sin on the first half), so a rotation is
    x * cos + swap_halves(x) * sin: bit-identical to HF's x * cos + rotate_half(x) * sin."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, dtype: torch.dtype = torch.float32):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        self.cos = torch.cat([angles.cos(), angles.cos()], dim=-1).float().to(dtype)
        self.sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).float().to(dtype)

    def to(self, dtype: torch.dtype) -> "Rope":
        self.cos, self.sin = self.cos.to(dtype), self.sin.to(dtype)
        return self

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, 1, D] (broadcast over heads)."""
        return self.cos[positions][:, :, None], self.sin[positions][:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D], cos/sin [B, T, 1, D] (Rope.tables) -> x rotated, [B, T, heads, D]."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat([x[..., half:], x[..., :half]], dim=-1), sin)


def _set_weight(module: nn.Module, name: str, value: "torch.Tensor | PackedLinear") -> None:
    """Replace a parameter by an inference weight (a PackedLinear is no parameter: not trained, not saved)."""
    module._parameters.pop(name, None)
    if isinstance(value, PackedLinear):
        object.__setattr__(module, name, value)
    else:
        module.register_parameter(name, nn.Parameter(value, requires_grad=False))


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP (the target's layers, and the EAGLE head's one layer)."""

    LINEARS = ("qkv", "o", "gate_up", "down")

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.qkv = nn.Parameter(torch.empty((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, dtype=dtype))
        self.o = nn.Parameter(torch.empty(h, cfg.num_heads * d, dtype=dtype))
        self.post_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h, dtype=dtype))
        self.down = nn.Parameter(torch.empty(h, cfg.intermediate_size, dtype=dtype))
        # row count -> whether every linear streams at it: asked once a layer a step (3.7 us, 0.1 ms
        # a SmolLM2 step), it depends only on the weights, which prepare_inference sets once.
        self._weights_stream: dict[int, bool] = {}
        self._kernel_weights: tuple | None = None  # forward_streamed's fixed arguments (kernel_weights)

    def prepare_inference(self, plan: "Calibration", quantized: "dict[str, Int8Weight | Q4Weight] | None" = None) -> None:
        """Pack the four linears as `plan` chose, in its dtype (those in `quantized` from those blocks instead of
        the parameters); norms cast to it."""
        quantized = quantized or {}
        for name in self.LINEARS:
            _set_weight(self, name, plan.pack(quantized.get(name, getattr(self, name))))
        for name in ("input_norm", "post_norm"):
            _set_weight(self, name, getattr(self, name).detach().to(plan.dtype))
        self._weights_stream.clear()
        self._kernel_weights = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: CacheBatch | None,
                index: int = 0) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; cos/sin [B, T, 1, D]. With a cache `batch` the new keys go to
        layer `index` of its cache at the batch's slots and attention reads the slot's history;
        without, attention is causal over the T tokens alone (training).

        When the batch has rows of different lengths (`batch.rows`: the flat indices of the real
        tokens), x is those N tokens [N, H] instead: every linear runs on them alone and only
        attention sees the padded [B, T] layout. A verify where one row drafts 4 tokens and seven
        draft none then costs 12 rows of matmuls, not 40 (the matmuls are compute-bound from a few
        rows on, on these CPUs)."""
        cfg = self.cfg
        nh, kvh = cfg.num_heads, cfg.num_kv_heads
        if batch is not None and batch.fused and self.streams(x):
            return self.forward_streamed(x, cos, sin, batch, index)
        residual = x
        qkv = linear(rms_norm(x, self.input_norm, cfg.rms_norm_eps), self.qkv)
        if batch is not None and batch.fused and not qkv.requires_grad:  # a decode or verify step: one C call
            attn = batch.attend_fused(index, qkv.reshape(-1, qkv.shape[-1]).contiguous(), cos.contiguous(),
                                      sin.contiguous(), nh)
            return self._mlp(residual + linear(attn.view(*x.shape[:-1], -1), self.o))
        bsz, t = cos.shape[:2]
        if batch is not None and batch.rows is not None:
            qkv = x.new_zeros(bsz * t, qkv.shape[-1]).index_copy_(0, batch.rows, qkv)
        qkv = qkv.view(bsz, t, nh + 2 * kvh, cfg.head_dim)
        qk = apply_rope(qkv[:, :, : nh + kvh], cos, sin)  # q and k rotated in one go
        q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + kvh:]
        if batch is None:
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            attn = batch.attend(index, q, k, v)
        attn = attn.reshape(bsz, t, nh * cfg.head_dim)
        if batch is not None and batch.rows is not None:
            attn = attn.reshape(bsz * t, -1).index_select(0, batch.rows)
        return self._mlp(residual + linear(attn, self.o))

    def streams(self, x: torch.Tensor) -> bool:
        """Whether this forward can be one `_cpu_kernels.layer` call: float32 inference, and every
        linear takes the stream kernel (one weight dtype) at x's row count."""
        return _kernel_input(x) and self.weights_stream(x.numel() // x.shape[-1])

    def weights_stream(self, rows: int) -> bool:
        """Whether every linear takes the stream kernel (one weight dtype, float32 norms) at `rows` rows."""
        if rows not in self._weights_stream:
            weights = [getattr(self, name) for name in self.LINEARS]
            self._weights_stream[rows] = cpu_kernels is not None and self.input_norm.dtype == torch.float32 \
                and all(isinstance(w, PackedLinear) and w.streams(rows) for w in weights) \
                and len({w.dtype for w in weights}) == 1
        return self._weights_stream[rows]

    def forward_streamed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: CacheBatch,
                         index: int, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` in one C call (when `streams(x)` and `batch.fused`): the same kernels in the same order, so the
        same values to the bit, without the ~120 us of Python and dispatch a layer between them. out (like x) and
        scratch (`scratch_size`): buffers to reuse."""
        cfg = self.cfg
        scratch = torch.empty(self.scratch_size(x.numel() // x.shape[-1])) if scratch is None else scratch
        out = torch.empty_like(x) if out is None else out
        k, v, slots, positions, flat, n, t, max_len = batch.kernel_args(index)
        rows = x.numel() // x.shape[-1]
        cpu_kernels.layer(out.data_ptr(), x.data_ptr(), scratch.data_ptr(), *self.kernel_weights(), k, v,
                          cos.contiguous().data_ptr(), sin.contiguous().data_ptr(), slots, positions, flat, n, t,
                          cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, max_len, torch.get_num_threads(),
                          *self.kernel_row(rows)[7:])
        return out

    def scratch_size(self, rows: int) -> int:
        """float32 values of the C layer call's intermediates for `rows` rows."""
        cfg = self.cfg
        return rows * (5 * cfg.hidden_size + self.qkv.out_features + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size)

    def kernel_row(self, rows: int) -> tuple[int, ...]:
        """This layer's row of `_cpu_kernels.layers`'s table at `rows` rows: the four weights, their kind, the two
        norms (pointers), then each linear's stream call at that row count as (gemm path, prefetch distance) (what
        `layer` takes last)."""
        w_qkv, w_o, w_gu, w_down, kind, norm_in, norm_post = self.kernel_weights()[:7]
        return (w_qkv, w_o, w_gu, w_down, kind, norm_in, norm_post,
                *(arg for name in self.LINEARS for arg in getattr(self, name).stream_args(rows)))

    def kernel_weights(self) -> tuple:
        """The C layer call's fixed arguments (weights, kind, norms, eps, H, Wq, I), read once: they change only
        with `prepare_inference`."""
        if self._kernel_weights is None:
            cfg = self.cfg
            self._kernel_weights = (self.qkv.stored.data_ptr(), self.o.stored.data_ptr(), self.gate_up.stored.data_ptr(),
                                    self.down.stored.data_ptr(), KIND[self.qkv.dtype], self.input_norm.data_ptr(),
                                    self.post_norm.data_ptr(), cfg.rms_norm_eps, cfg.hidden_size, self.qkv.out_features,
                                    cfg.intermediate_size)
        return self._kernel_weights

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] (after attention's residual) -> x + the SwiGLU MLP of its norm."""
        return x + linear(silu_mul(linear(rms_norm(x, self.post_norm, self.cfg.rms_norm_eps), self.gate_up)), self.down)


class Llama(nn.Module):
    """The target. Built with plain float32 parameters (what the trainers backpropagate through);
    `prepare_inference(plan)` turns it into the serving form: each linear packed once as the
    calibration chose, in its weight dtype; activations and KV cache in the plan's dtype (float32)."""

    head_only = False  # `load_llama_head`: embeddings, norm, head and the top layer only; no forward

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype=dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        # Tied embeddings share one tensor, so a swap that copies into `embed` updates the head too.
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(torch.empty_like(self.embed))
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, dtype)
        self.prepared = False
        self._layer_tables: dict[int, torch.Tensor] = {}  # rows -> `_cpu_kernels.layers`'s table, once prepared
        self._layers_stream_at: dict[int, bool] = {}  # rows -> whether every layer streams there (_layers_stream)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def prepare_inference(self, plan: "Calibration",
                          quantized: "dict[str, Int8Weight | Q4Weight] | None" = None) -> "Llama":
        """Pack every linear (layers and head) once, as `plan` measured fastest here, in plan.dtype. `quantized`:
        weights by this model's names (`layers.3.qkv`, `embed`) to pack from those blocks instead of the
        parameters (`gguf_reader.load_gguf`).

        The packed weights then move into one mapping of 2 MB pages (`huge_pages`).

        A tied head stays a weight with row access (plain or transposed storage, whichever `plan`
        measured faster): the embedding lookup reads its rows, so no second copy is kept. The cost,
        measured for SmolLM2's [49152, 576] head on the AVX2 EPYC (1 thread): a oneDNN-packed copy
        would take 6.7 / 10.9 / 12.0 ms at 1 / 5 / 8 rows against the plain head's best 7.4 / 12.8 /
        17.2 (expected 17.1 against 21.7 ms over the row buckets), for +113 MB (+21% of the model).
        Inference only: afterwards `load_hf_state` refuses (load into a fresh model), `hf_state`
        unpacks."""
        if self.prepared:
            raise ValueError("this model is already prepared for inference")
        quantized = quantized or {}
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.prepare_inference(plan, {name.rpartition(".")[2]: value for name, value in quantized.items()
                                               if name.startswith(f"layers.{i}.")})
            tied = self.cfg.tie_word_embeddings
            head = plan.pack(quantized.get("embed" if tied else "lm_head", self.lm_head), head=True, tied=tied)
            if self.cfg.tie_word_embeddings:
                _set_weight(self, "embed", head)
            else:
                _set_weight(self, "embed", self.embed.detach().to(plan.dtype))
            _set_weight(self, "lm_head", head)
            _set_weight(self, "norm", self.norm.detach().to(plan.dtype))
            # what a step streams, in 2 MB pages (huge_pages: a q4 B=1 forward 4.63 -> 3.67 ms on a Zen 4 EPYC)
            move_into_huge_pages(w for w in self.streamed_weights() if isinstance(w, PackedLinear))
        self.rope.to(plan.dtype)
        self._layer_tables.clear()
        self._layers_stream_at.clear()
        self.prepared = True
        return self

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(self.cfg.num_layers, num_slots, max_len, self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] int64 -> embeddings [..., H] in the model's dtype."""
        if isinstance(self.embed, PackedLinear):  # a tied head's rows (float16 weights: cast to the model's dtype)
            return self.embed.rows(tokens).to(self.dtype)
        return F.embedding(tokens, self.embed)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 -> lm_head rows [N, H] (a reduced draft head's start)."""
        if isinstance(self.lm_head, PackedLinear):
            return plain_weight(self.lm_head)[ids]
        return self.lm_head.detach()[ids]

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor | None = None, start: torch.Tensor | None = None,
                cache: KVCache | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] int64 at positions start[b] .. start[b]+T-1 of slot slots[b] -> hidden [B, T, H] float32
        (the last layer's output before the final norm). lengths [B] int64 (with a cache): row b has only lengths[b]
        real tokens (the rest is padding: computed by attention only, its hidden states are 0). Without a cache:
        whole sequences from position 0, causal (the trainer's feature pass; right padding does not leak backwards)."""
        if self.head_only:
            raise ValueError("a head-only target (load_llama_head) has no layers to compute features with")
        if cache is not None and tokens.shape[1] > FUSED_MAX_TOKENS and lengths is None and fuses(cache):
            return torch.cat([self(tokens[:, i:i + FUSED_MAX_TOKENS], slots, start + i, cache)  # a long prompt chunk
                              for i in range(0, tokens.shape[1], FUSED_MAX_TOKENS)], dim=1)
        x = self.embed_tokens(tokens)
        if cache is None:
            cos, sin = self.rope.tables(torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1))
            for layer in self.layers:
                x = layer(x, cos, sin, None)
            return x
        batch = CacheBatch(cache, slots, start, tokens.shape[1], lengths)
        cos, sin = self.rope.tables(batch.positions)
        if batch.rows is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, batch.rows)
        if batch.fused and self._layers_stream(x):
            x = self._forward_streamed(x, cos.contiguous(), sin.contiguous(), batch)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, batch, i)
        if batch.rows is not None:
            bsz, t = tokens.shape
            return x.new_zeros(bsz * t, x.shape[-1]).index_copy_(0, batch.rows, x).view(bsz, t, -1).float()
        return x.float()

    def _layers_stream(self, x: torch.Tensor) -> bool:
        """Whether every layer's forward over x can run in the one C call (`DecoderLayer.streams`), asked of the
        layers once per row count: 30 questions a step took 0.14 ms, 4% of a q4 decode step (AMX Xeon)."""
        if not _kernel_input(x):
            return False
        rows = x.numel() // x.shape[-1]
        known = self._layers_stream_at.get(rows)
        if known is None:
            known = self._layers_stream_at[rows] = all(layer.weights_stream(rows) for layer in self.layers)
        return known

    def _forward_streamed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: CacheBatch) -> torch.Tensor:
        """Every layer's `forward_streamed` in one C call (`_cpu_kernels.layers`: the same kernels in the same
        order, so the same bits), with one scratch and two hidden-state buffers for all of them (x is never
        written): the Python between 30 layer calls was ~0.3 ms of a 4-5 ms q4 decode step (AVX2 EPYC), during
        which the other compute thread waits."""
        rows = x.numel() // x.shape[-1]
        scratch = torch.empty(self.layers[0].scratch_size(rows))
        buffers = (torch.empty_like(x), torch.empty_like(x))
        table = self._layer_tables.get(rows)
        if table is None:  # the weights' pointers and calls are fixed once prepared
            table = self._layer_tables[rows] = torch.tensor([layer.kernel_row(rows) for layer in self.layers],
                                                            dtype=torch.int64)
        cfg = self.cfg
        k, v, slots, positions, flat, n, t, max_len = batch.kernel_args(0)
        cpu_kernels.layers(buffers[0].data_ptr(), buffers[1].data_ptr(), x.data_ptr(), scratch.data_ptr(),
                           table.data_ptr(), len(self.layers), cfg.rms_norm_eps, cfg.hidden_size,
                           self.layers[0].qkv.out_features, cfg.intermediate_size, k, v, batch.layer_bytes,
                           cos.data_ptr(), sin.data_ptr(), slots, positions, flat, n, t, cfg.num_heads,
                           cfg.num_kv_heads, cfg.head_dim, max_len, torch.get_num_threads())
        return buffers[(len(self.layers) - 1) % 2]

    def logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] float32; `head` [V', H]: rows of lm_head to use instead."""
        x = rms_norm(hidden.to(self.dtype), self.norm, self.cfg.rms_norm_eps)
        return linear(x, self.lm_head if head is None else head).float()

    def streamed_weights(self) -> list["torch.Tensor | PackedLinear"]:
        """The weights one decode forward reads: every layer linear, then the output head once."""
        return [getattr(l, name) for l in self.layers for name in DecoderLayer.LINEARS] + [self.lm_head]

    def streamed_weight_bytes(self) -> int:
        """Bytes of weights one decode forward reads (`streamed_weights`)."""
        return sum(w.nbytes for w in self.streamed_weights())

    # ---- weights -------------------------------------------------------------------------
    def _weights(self) -> dict[str, "torch.Tensor | PackedLinear"]:
        """hf_layout's names -> this model's tensor (or packed weight) under that name."""
        out = {}
        for name in hf_layout(self.cfg):
            owner, _, attr = name.rpartition(".")
            out[name] = getattr(self.get_submodule(owner) if owner else self, attr)
        return out

    def load_hf_state(self, source: "dict[str, torch.Tensor] | TensorSource") -> None:
        """Copy HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...) into this model,
        one tensor at a time, read straight into the parameter (q, k, v land in row slices of the
        fused qkv; gate, up in gate_up), so loading holds at most one tensor beyond the model.

        Names and shapes are all checked before anything is copied (WeightsMismatch names the
        first problem). Values are checked while copying; a non-finite tensor stops the load
        part-way, so load into a fresh model (hot swaps always do)."""
        if self.prepared:
            raise ValueError("a model prepared for inference cannot be loaded into: build a fresh one (load_llama)")
        source = source if isinstance(source, TensorSource) else TensorSource(source)
        params = self._weights()
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
                    rows = source.shape(part)[0]
                    target = params[name][offset: offset + rows]
                    dtype = source.dtype(part)
                    if dtype is None or not dtype.is_floating_point:
                        raise WeightsMismatch(f"{part}: not finite floating-point values")
                    source.read_into(part, target)
                    if not torch.isfinite(target).all():
                        raise WeightsMismatch(f"{part}: not finite floating-point values")
                    offset += rows

    def hf_state(self) -> dict[str, torch.Tensor]:
        """This model's weights under HF Llama names (the inverse of `load_hf_state`), unpacked."""
        cfg = self.cfg
        qkv_rows = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        weights = self._weights()
        out = {}
        for name, parts in hf_layout(cfg).items():
            value = plain_weight(weights[name])
            rows = qkv_rows if name.endswith(".qkv") else [value.shape[0] // len(parts)] * len(parts)
            for part, piece in zip(parts, value.split(rows)):
                out[part] = piece.contiguous()
        return out


class TensorSource:
    """HF tensors by name, from a dict or from safetensors files read with plain file reads.

    A file tensor is read straight into the destination (`read_into`), not through a memory map:
    mapped pages count in the process's RSS until the map closes, so loading SmolLM2 through
    `safe_open` peaked at the model plus the whole 538 MB file."""

    DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, files: list[Path] | None = None):
        self._tensors = tensors or {}
        self._entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}  # path, dtype, shape, begin, end
        for path in files or []:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for key, meta in header.items():
                if key != "__metadata__":
                    begin, end = meta["data_offsets"]
                    self._entries[key] = (Path(path), meta["dtype"], tuple(meta["shape"]), 8 + size + begin, 8 + size + end)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "TensorSource":
        """Every *.safetensors file of an HF model directory."""
        return cls(files=sorted(Path(model_dir).glob("*.safetensors")))

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        if name in self._entries:
            return self._entries[name][2]
        return None

    def dtype(self, name: str) -> torch.dtype | None:
        if name in self._tensors:
            return self._tensors[name].dtype
        return self.DTYPES.get(self._entries[name][1])

    def get(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._tensors[name]
        if self.dtype(name) is None:
            raise WeightsMismatch(f"{name}: dtype {self._entries[name][1]} is not supported")
        out = torch.empty(self._entries[name][2], dtype=self.dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor `name` into `out` (same shape, contiguous; cast to out's dtype when they
        differ, through one temporary tensor)."""
        if name in self._tensors:
            out.copy_(self._tensors[name])
            return
        path, dtype, shape, begin, end = self._entries[name]
        dest = out.detach() if self.dtype(name) == out.dtype else torch.empty(shape, dtype=self.dtype(name))
        view = dest.view(torch.uint8).numpy().reshape(-1)
        if end - begin != view.nbytes:
            raise OSError(f"{name}: {end - begin} bytes in {path.name} for a {list(shape)} {dtype} tensor")
        with open(path, "rb") as f:
            f.seek(begin)
            if f.readinto(view) != view.nbytes:
                raise OSError(f"{name}: {path.name} is truncated")
        if dest.data_ptr() != out.data_ptr():
            out.copy_(dest)


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


def load_llama_head(model_dir: Path) -> Llama:
    """What a drafter needs of its target when the features come with the records: the embeddings,
    the final norm, the output head and the top decoder layer (a day-0 drafter starts from it),
    read from an HF directory into plain float32 parameters. SmolLM2: 127 MB (its head is tied to
    the embeddings) instead of 538 MB. Not a model: `layers` holds the top layer only, `cfg` says
    one layer, and `forward` refuses to run."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelNotFoundError(f"{model_dir} has no config.json")
    cfg = LlamaConfig.from_dir(model_dir)
    model = Llama(replace(cfg, num_layers=1))
    source = TensorSource.from_dir(model_dir)
    top = f"model.layers.{cfg.num_layers - 1}."
    source._entries = {(name.replace(top, "model.layers.0.", 1) if name.startswith(top) else name): entry
                       for name, entry in source._entries.items()
                       if not name.startswith("model.layers.") or name.startswith(top)}
    model.load_hf_state(source)
    model.head_only = True
    return model


def load_llama(model_dir: Path, plan: "Calibration | None" = None) -> Llama:
    """Build the target from an HF safetensors directory (config.json + *.safetensors).

    Without a plan: plain float32 parameters (training, tests). With one (the engine's, from
    `Calibration.open`): read straight into parameters of plan.dtype, then packed for inference."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelNotFoundError(f"{model_dir} has no config.json")
    model = Llama(LlamaConfig.from_dir(model_dir), dtype=plan.dtype if plan is not None else torch.float32)
    if plan is not None and plan.weight_dtype == torch.quint4x2:
        from specrl.models.gguf_reader import load_gguf, shipped_gguf

        gguf = shipped_gguf(model_dir)
        if gguf is not None:
            return load_gguf(model, gguf, plan)  # 4 bits as the model ships them
    model.load_hf_state(TensorSource.from_dir(model_dir))
    return model.prepare_inference(plan) if plan is not None else model
