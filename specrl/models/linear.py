"""The matmul call for a linear layer: plain for training, calibrated for inference.

`linear(x, weight)` with a plain [OUT, IN] tensor is the training path (and the default for
a model nobody prepared): `F.linear` for large M or under autograd, `W @ x.T` with row-major
rows in and out for <= 16 rows (a column-major input takes MKL's other path, measured 5x slower).

An inference model holds each weight as a `PackedLinear` instead: ONE copy of the weight in
one storage, and per row count the call measured fastest from that storage on this machine
(`specrl.models.calibration` measures and picks). No call wins everywhere, and which one wins
depends on the CPU (measured: on an AVX2 EPYC `x @ Wt` wins at one row and oneDNN's packed
layout from two rows on; on an AVX-512 one oneDNN wins from three rows), so nothing here is
hard-coded to one machine.

Storages (`STORAGES`): `plain` [OUT, IN] (the checkpoint's), `transposed` [IN, OUT]
contiguous, `onednn` (oneDNN's blocked layout, an opaque mkldnn tensor: no row access), and
`blocked` [OUT/16, IN, 16] (16 outputs per contiguous stream: the layout of the `stream` call,
our own kernel in `_cpu_kernels.c`, which reads the weight once for all rows and holds float32,
float16, bfloat16, int8 or 4-bit weights; bfloat16 in pairs of inputs, for AMX tiles and AVX512-BF16; int8
as [OUT/16, IN + IN/8, 16] and 4-bit as bytes [OUT/16, 10 IN], per block and group of 32 inputs the rows
of an integer dot product, then the group's scales (`_cpu_quant.c`, `specrl.models.quantize`)). Calls
(`CALLS`) take x2 [M, IN] row-major and return [M, OUT] row-major, in the weight's dtype (float32 or
bfloat16; the libraries accumulate bf16 products in float32), except the "mixed" calls, which take
half-precision (float16 or bfloat16) weights with float32 x2 and return float32: a served model keeps
its activations in float32 whatever its weights.

Why a kernel of our own (measured on an AVX-512 EPYC, 2 threads, SmolLM2's [3072, 576] from
memory, us per call at M = 1 / 5 / 8): oneDNN's packed float32 302 / 252 / 311 (19-28 GB/s),
`stream` float32 203 / 204 / 243 (35 GB/s, flat to 5 rows), `stream` float16 106 / 125 / 176,
oneDNN bfloat16 167 at M = 1. oneDNN reorders and dispatches per call for a shape it treats as a
GEMM; a decode step is a weight stream. On an AMX Xeon (2 threads, 30 GB/s read), all the layers' and
the head's matmuls of SmolLM2 at 1 / 5 / 16 / 40 rows: `stream` float32 19.3 / 20.2 / 31.7 / 54.1 ms,
float16 10.1 / 12.1 / 23.9 / 51.5, bfloat16 on AMX tiles 11.3 / 11.8 / 11.6 / 17.6 (on AVX512-BF16's
dot product 10.5 / 12.5 / 28.5 / 64.2: AMX is the one path there, so every row count sums alike).

Measured and left out (AVX2 EPYC, torch 2.13, 1 thread, SmolLM2's linears, ms per forward at
M=1/5/8): MKL's packed GEMM (`torch.ops.mkl._mkl_reorder_linear_weight` + `_mkl_linear`,
31.3/73.6/77.1 against oneDNN's 35.7/49.4/61.6) packs for ONE row count, falls back to the
original weight for any other (two copies), and its buffer is 3.6x the weight; `Wt.t() @ x.t()`
(800+ at M>=2); oneDNN on an unpacked weight (`_linear_pointwise` on [OUT, IN]: 1.5-1.9x the
packed one from M=2); torch.compile (see llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from specrl.models.quantize import GROUP, QUANTIZED, Int8Weight, Q4Weight

try:
    from specrl.models import _cpu_kernels as cpu_kernels
except ImportError:  # not built (a source tree without `make install`): the other storages serve
    cpu_kernels = None

# Whether the kernel multiplies bfloat16 weights on the CPU's bf16 units here (AMX or AVX512-BF16); its
# scalar C fallback is never a candidate: F.linear serves bfloat16 weights on such a CPU.
NATIVE_BF16 = cpu_kernels is not None and cpu_kernels.path(64, 2, 64) != "portable"

SMALL_M = 16
MAX_ROWS = 512  # row counts above this use the call chosen for this many rows
BLOCK = 16  # outputs per stream of the `blocked` storage (the kernel's layout)


def linear(x: torch.Tensor, weight: "torch.Tensor | PackedLinear") -> torch.Tensor:
    """x [..., IN] float32/bfloat16, weight [OUT, IN] (or a PackedLinear) -> [..., OUT]."""
    if isinstance(weight, PackedLinear):
        return weight(x)
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_M or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight)
    # Row-major rows in and out: `W @ x2.t()` with x2 column-major (what a transposed result fed
    # back in would be) takes MKL's other path, measured 5x slower ([3072, 576] @ [576, 2]:
    # 62 vs 12 ms per 30 layers); it made every verify forward ~1.8x a one-token forward.
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:
        x2 = torch.cat([x2, x2])
    out = (weight @ x2.t()).t()[:rows].contiguous()
    return out.reshape(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class Storage:
    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]  # plain [OUT, IN] -> stored
    unpack: Callable[[torch.Tensor], torch.Tensor]  # stored -> plain [OUT, IN] (a view when it can be)
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None  # (stored, ids [N]) -> [N, IN]; None: no row access


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    # The pack hint is a row count; measured on the AVX2 EPYC (torch 2.13, 1 thread): hints 2..512
    # give the same layout and speed at every M, hint 1 one that is 1.7x slower from 2 rows on.
    return torch.ops.mkldnn._reorder_linear_weight(w, SMALL_M)


def _blocked_pack(w: "torch.Tensor | Int8Weight | Q4Weight") -> torch.Tensor:
    """[OUT, IN] -> [ceil(OUT/16), IN, 16] float32/float16, or [ceil(OUT/16), IN/2, 16, 2] bfloat16
    (pairs of inputs: the rows of AVX512-BF16's dot product and of AMX's B tiles), or an Int8Weight's
    or Q4Weight's groups (`_blocked_pack_int8`, `_blocked_pack_q4`); OUT padded with zero rows. RuntimeError where the kernel cannot serve it (the calibration then leaves the
    storage out for this weight)."""
    if cpu_kernels is None:
        raise RuntimeError("the stream kernel (specrl.models._cpu_kernels) is not built")
    if isinstance(w, Int8Weight):
        return _blocked_pack_int8(w)
    if isinstance(w, Q4Weight):
        return _blocked_pack_q4(w)
    if w.dtype in (torch.int8, torch.uint8, torch.quint4x2):
        raise RuntimeError("int8 and 4-bit weights are packed from an Int8Weight or Q4Weight (values and scales), "
                           "not a bare tensor")
    if w.dtype not in KIND:
        raise RuntimeError(f"the stream kernel takes float32, float16 or bfloat16 weights, not {w.dtype}")
    out_features, in_features = w.shape
    if w.dtype == torch.bfloat16 and in_features % 2:
        raise RuntimeError(f"the stream kernel takes bfloat16 weights in pairs of inputs, not {in_features}")
    padded = -(-out_features // BLOCK) * BLOCK
    if padded != out_features:
        w = torch.cat([w, w.new_zeros(padded - out_features, in_features)])
    if w.dtype == torch.bfloat16:
        return w.view(padded // BLOCK, BLOCK, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.view(padded // BLOCK, BLOCK, in_features).transpose(1, 2).contiguous()


I8_SCALE_ROWS = 4  # a group's 16 float32 scales: 64 bytes, 4 rows of 16 int8


def _pad_outputs(w: "Int8Weight | Q4Weight") -> tuple[int, list[torch.Tensor]]:
    """-> (column blocks, [q, then the per-group parameters]) with OUT padded to whole blocks: zero weights, scale 1,
    minimum 0."""
    parts = [w.q, w.scale] + ([w.minimum] if isinstance(w, Q4Weight) else [])
    extra = -w.shape[0] % BLOCK
    if extra:
        fill = [0, 1, 0]
        parts = [torch.cat([p, torch.full((extra, p.shape[1]), fill[i], dtype=p.dtype)]) for i, p in enumerate(parts)]
    return (w.shape[0] + extra) // BLOCK, parts


def _per_group(p: torch.Tensor, blocks: int) -> torch.Tensor:
    """[OUT, G] per output and group -> [OUT/16, G, 16 * itemsize] bytes: each block's group's 16 values."""
    return p.view(blocks, BLOCK, -1).transpose(1, 2).contiguous().view(torch.uint8)


def _blocked_pack_int8(w: Int8Weight) -> torch.Tensor:
    """-> [OUT/16, IN + IN/8, 16] int8: per block, per group of 32 inputs, 8 rows of 64 bytes (row r: output j's
    q + 128 for inputs 4r..4r+3 at bytes 4j..4j+3: the unsigned lanes of an integer dot product), then the 16
    float32 scales (`_cpu_quant.c`)."""
    blocks, (q, scale) = _pad_outputs(w)
    groups = w.shape[1] // GROUP
    lanes = (q ^ -128).view(blocks, BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 8 * 64)
    packed = torch.cat([lanes.view(torch.uint8), _per_group(scale, blocks)], dim=2)  # [OUT/16, G, 576]
    return packed.view(torch.int8).reshape(blocks, -1, BLOCK).contiguous()


def _int8_parts(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 blocked storage (or some of its blocks) -> (q [B, IN, 16] int8, scales per input [B, IN, 16]
    float32)."""
    groups = _blocked_in_features(s) // GROUP
    packed = s.reshape(s.shape[0], groups, 9 * 64)
    q = (packed[:, :, : 8 * 64] ^ -128).reshape(s.shape[0], groups, 8, BLOCK, 4).permute(0, 1, 2, 4, 3)
    scales = packed[:, :, 8 * 64:].contiguous().view(torch.float32)  # [B, G, 16]
    return q.reshape(s.shape[0], groups * GROUP, BLOCK), scales.repeat_interleave(GROUP, dim=1)


def _blocked_pack_q4(w: Q4Weight) -> torch.Tensor:
    """-> bytes [OUT/16, 10 IN]: per block, per group of 32 inputs, 4 rows of 64 bytes (row r, byte 4j + t:
    output j's q for input 8r + t in the low nibble, 8r + 4 + t in the high one), then 16 float16 scales
    and 16 float16 minimums (`_cpu_quant.c`)."""
    blocks, (q, scale, minimum) = _pad_outputs(w)
    groups = w.shape[1] // GROUP
    q = q.view(blocks, BLOCK, groups, 4, 2, 4)  # [block, lane, group, row, nibble, t]
    nibbles = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 4 * 64)
    packed = torch.cat([nibbles, _per_group(scale, blocks), _per_group(minimum, blocks)], dim=2)  # [OUT/16, G, 320]
    return packed.reshape(blocks, -1).contiguous()


def _q4_parts(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit blocked storage (or some of its blocks) -> (q, scale, minimum), each [B, IN, 16] (q uint8,
    the others float32, per input)."""
    groups = _blocked_in_features(s) // GROUP
    packed = s.reshape(s.shape[0], groups, 5 * 64)
    nibbles = packed[:, :, : 4 * 64].reshape(s.shape[0], groups, 4, BLOCK, 4)
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=3)  # [B, G, row, nibble, lane, t]
    q = q.permute(0, 1, 2, 3, 5, 4).reshape(s.shape[0], groups * GROUP, BLOCK)
    params = packed[:, :, 4 * 64:].contiguous().view(torch.float16).reshape(s.shape[0], groups, 2, BLOCK).float()
    return q, params[:, :, 0].repeat_interleave(GROUP, dim=1), params[:, :, 1].repeat_interleave(GROUP, dim=1)


def _blocked_unpack(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.uint8:  # 4-bit, dequantized: float32
        q, scale, minimum = _q4_parts(s)
        return (q.float() * scale + minimum).transpose(1, 2).reshape(s.shape[0] * BLOCK, q.shape[1])
    if s.dtype == torch.int8:  # dequantized: float32
        q, scales = _int8_parts(s)
        return (q.float() * scales).transpose(1, 2).reshape(s.shape[0] * BLOCK, q.shape[1])
    if s.dim() == 4:  # bfloat16 pairs
        return s.permute(0, 2, 1, 3).reshape(s.shape[0] * BLOCK, s.shape[1] * 2)
    return s.transpose(1, 2).reshape(s.shape[0] * BLOCK, s.shape[1])


def _blocked_rows(s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a blocked storage (an embedding lookup): their blocks, then each row's lane."""
    if s.dtype in (torch.int8, torch.uint8) and cpu_kernels is not None:  # int8 / 4-bit: dequantized, float32
        ids = ids.contiguous().to(torch.int64)
        out = torch.empty(len(ids), _blocked_in_features(s))
        # one C call: the torch ops below took ~100 us for one decode token's lookup (AMX Xeon), ~3% of its step
        cpu_kernels.quant_rows(out.data_ptr(), s.data_ptr(), ids.data_ptr(), len(ids), out.shape[1],
                               s.shape[0] * BLOCK, KIND[s.dtype])
        return out
    block, lane = torch.div(ids, BLOCK, rounding_mode="floor"), ids % BLOCK
    if s.dtype in (torch.int8, torch.uint8):  # the same without the kernel (its reference in the tests)
        return _quantized_rows(s.index_select(0, block), lane)
    blocks, rows = s.index_select(0, block), torch.arange(len(ids))
    if s.dim() == 4:  # bfloat16 pairs: [N, IN/2, 2] -> [N, IN]
        return blocks[rows, :, lane].reshape(len(ids), -1)
    return blocks[rows, :, lane]


def _quantized_rows(blocks: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Lane `lane[i]` of int8 or 4-bit block `blocks[i]`, dequantized -> float32 [N, IN]: only those rows' bytes
    gathered from the blocks (unpacking the whole blocks took 7 ms for a 512-token prefill's lookup in SmolLM2's
    int8 head, this 0.8)."""
    n, int8 = len(lane), blocks.dtype == torch.int8
    groups = _blocked_in_features(blocks) // GROUP
    packed = blocks.view(torch.uint8).reshape(n, groups, (9 if int8 else 5) * 64)
    rows = 8 if int8 else 4  # 64-byte rows of a group: 4 inputs of every lane each
    at = (torch.arange(rows)[:, None] * 64 + torch.arange(4)) + 4 * lane[:, None, None]  # [N, rows, 4]
    picked = packed.gather(2, at.reshape(n, 1, -1).expand(n, groups, -1))  # [N, G, rows * 4]
    params = packed[:, :, rows * 64:].contiguous()
    if int8:
        scale = params.view(torch.float32).gather(2, lane.reshape(n, 1, 1).expand(n, groups, 1))
        return ((picked ^ 128).view(torch.int8).float() * scale).reshape(n, -1)
    d_m = params.view(torch.float16).reshape(n, groups, 2, BLOCK).float()
    d, m = d_m.gather(3, lane.reshape(n, 1, 1, 1).expand(n, groups, 2, 1)).unbind(2)  # [N, G, 1] each
    nibbles = picked.reshape(n, groups, 4, 4)  # [N, G, row, t]: inputs 8 row + t (low), 8 row + 4 + t (high)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=3).reshape(n, groups, GROUP)
    return (q.float() * d + m).reshape(n, -1)


def _blocked_in_features(s: torch.Tensor) -> int:
    if s.dtype == torch.uint8:  # 4-bit: 8 bytes an input, then 64 bytes a group of 32: 10 bytes an input
        return s.shape[1] // 10
    if s.dtype == torch.int8:  # IN rows, then IN / GROUP groups of I8_SCALE_ROWS rows
        return s.shape[1] * GROUP // (GROUP + I8_SCALE_ROWS)
    return s.shape[1] * 2 if s.dim() == 4 else s.shape[1]


STORAGES = {
    "plain": Storage("plain", lambda w: w, lambda s: s, lambda s, ids: F.embedding(ids, s)),
    "transposed": Storage("transposed", lambda w: w.t().contiguous(), lambda s: s.t(),
                          lambda s, ids: s.index_select(1, ids).t()),
    "onednn": Storage("onednn", _onednn_pack, lambda s: s.to_dense(), None),
    "blocked": Storage("blocked", _blocked_pack, _blocked_unpack, _blocked_rows),
}


F32, F16, BF16, I8, Q4 = torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.quint4x2
# the stream kernel's weight kinds, by the weight's dtype and by its packed storage's (4-bit: bytes)
KIND = {F32: 0, F16: 1, BF16: 2, I8: 3, Q4: 4, torch.uint8: 4}
SAME = ((F32, F32), (BF16, BF16))  # x2 in the weight's dtype: what the libraries' calls take
HALF = ((F16, F32), (BF16, F32))  # half-precision weights with float32 x2: the "mixed" calls


@dataclass(frozen=True)
class Call:
    name: str
    storage: str
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x2 [M, IN], stored) -> [M, OUT]
    max_rows: int = MAX_ROWS  # 1: a single-row (matrix-vector) call
    dtypes: tuple[tuple[torch.dtype, torch.dtype], ...] = SAME  # the (weight, x2) dtypes it takes


def _w_xt(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w @ x2.t()).t().contiguous()


def _w_xt_pad2(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w @ torch.cat([x2, x2]).t()).t()[:1].contiguous()


def _onednn(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2, w, None, "none", [], "")


def _stream(x2: torch.Tensor, w: torch.Tensor, prefetch: int = 0, path: int = 0) -> torch.Tensor:
    """x2 [M, IN] float32 contiguous, w blocked (`_blocked_pack`) float32/float16/bfloat16/int8 -> [M, OUT]
    float32 (OUT padded to a multiple of 16: PackedLinear cuts the padding off). bfloat16 weights
    multiply x rounded to bfloat16 (AMX, else AVX512-BF16), products summed in float32; int8 and 4-bit
    weights multiply x rounded to int8 per group of 32 (`quantize.matmul_reference`), prefetching `prefetch`
    bytes ahead of each weight group (0: none), on `path` (`_cpu_kernels.gemm`'s: 0 the best the CPU has,
    PATH_AMX_INT8 AMX-INT8 tiles; every path gives the same bits)."""
    rows, in_features = x2.shape
    if x2.dtype != torch.float32 or _blocked_in_features(w) != in_features:
        raise ValueError(f"stream: x {list(x2.shape)} {x2.dtype} does not fit a blocked {list(w.shape)} weight")
    out = torch.empty(rows, w.shape[0] * BLOCK)
    cpu_kernels.gemm(out.data_ptr(), x2.data_ptr(), w.data_ptr(), rows, in_features, out.shape[1], KIND[w.dtype],
                     torch.get_num_threads(), path, prefetch)
    return out


# int8 and 4-bit weights' software prefetch distance: 2 KB ahead of each weight group. Whether prefetching pays
# differs by CPU (_cpu_quant.c: 10-15% faster at 1-5 rows on the AVX2 EPYC, 15-20% slower on the AVX-512 EPYC;
# 1, 2, 4 and 8 KB within 5% of one another), so it is a call of its own that the calibration times beside "stream".
PREFETCH_BYTES = 2048


def _stream_prefetch(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`_stream` prefetching PREFETCH_BYTES ahead (int8 and 4-bit weights): the same bits."""
    return _stream(x2, w, PREFETCH_BYTES)


# int8 and 4-bit weights on AMX-INT8 tiles (_cpu_quant.c): one tile product a group for up to 16 rows instead of 8
# VPDPBUSD a row, whose sums take a trip through memory to be scaled; a call of its own, which the calibration
# times beside the VNNI ones per shape and row count, offered only where the CPU has the tiles. Measured on an AMX
# Xeon (2 threads, one forward's matmuls, VNNI with prefetch / AMX, ms): q4 2.68 / 3.73 at 1 row, 3.44 / 4.68 at 5,
# 5.09 / 5.47 at 8, 8.86 / 7.22 at 16; int8 4.51 / 4.65, 5.32 / 5.58, 6.78 / 6.59, 10.28 / 10.02. It prefetches
# as "stream prefetch" does (without: 10% slower there).
PATH_AMX_INT8 = 4  # _cpu_kernels.gemm's path
AMX_INT8 = cpu_kernels is not None and cpu_kernels.path(BLOCK, KIND[I8], GROUP, PATH_AMX_INT8) == "amx_int8"


def _stream_amx(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`_stream` on AMX-INT8 tiles, prefetching (int8 and 4-bit weights): the same bits."""
    return _stream(x2, w, PREFETCH_BYTES, PATH_AMX_INT8)


# the stream calls -> (gemm path, prefetch distance): what `_cpu_kernels.layer` takes per linear
STREAM_ARGS = {_stream: (0, 0), _stream_prefetch: (0, PREFETCH_BYTES), _stream_amx: (PATH_AMX_INT8, PREFETCH_BYTES)}


CALLS = {c.name: c for c in [
    Call("F.linear", "plain", lambda x2, w: F.linear(x2, w)),
    Call("W@x.T", "plain", _w_xt),
    Call("W@x.T pad2", "plain", _w_xt_pad2, max_rows=1),  # the old `linear`'s single row
    Call("mv", "plain", lambda x2, w: torch.mv(w, x2[0])[None], max_rows=1),
    Call("x@Wt", "transposed", lambda x2, wt: x2 @ wt),
    Call("mv Wt", "transposed", lambda x2, wt: torch.mv(wt.t(), x2[0])[None], max_rows=1),
    Call("onednn", "onednn", _onednn),
    Call("stream", "blocked", _stream, dtypes=((F32, F32), (F16, F32), (I8, F32), (Q4, F32)) + ((BF16, F32),) * NATIVE_BF16),
    Call("stream prefetch", "blocked", _stream_prefetch, dtypes=((I8, F32), (Q4, F32))),
    Call("stream amx", "blocked", _stream_amx, dtypes=((I8, F32), (Q4, F32)) * AMX_INT8),
    Call("upcast", "plain", lambda x2, w: F.linear(x2, w.to(x2.dtype)), dtypes=HALF),  # odd shapes
]}


def calls_for(storage: str, rows: int, weight_dtype: torch.dtype = F32, x_dtype: torch.dtype | None = None) -> list[Call]:
    """The calls from `storage` for `rows` rows that take `weight_dtype` weights with x2 of `x_dtype`
    (None: the weight's)."""
    pair = (weight_dtype, weight_dtype if x_dtype is None else x_dtype)
    return [c for c in CALLS.values() if c.storage == storage and rows <= c.max_rows and pair in c.dtypes]


class PackedLinear:
    """One inference weight: stored once as `storage`, called by the call chosen per row bucket.

    `buckets` (ascending row counts) and `calls` (a call name per bucket): rows M use the call of
    the smallest bucket >= M (the last bucket's above it)."""

    def __init__(self, weight: "torch.Tensor | Int8Weight | Q4Weight", storage: str, buckets: tuple[int, ...],
                 calls: tuple[str, ...]):
        """weight [OUT, IN] plain (or quantized); the PackedLinear keeps the packed copy only."""
        if any(CALLS[c].storage != storage for c in calls):
            raise ValueError(f"calls {calls} do not all work from storage {storage!r}")
        self.shape, self.dtype, self.storage = tuple(weight.shape), weight.dtype, storage
        self.out_features, self.in_features = self.shape
        self.stored = STORAGES[storage].pack(weight if isinstance(weight, QUANTIZED) else weight.detach().contiguous())
        self.calls = dict(zip(buckets, calls))
        self._by_rows: list[Callable] = []
        for rows in range(MAX_ROWS + 1):
            bucket = next((b for b in buckets if b >= rows), buckets[-1])
            self._by_rows.append(CALLS[self.calls[bucket]].fn)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., IN] in the weight's dtype -> [..., OUT]."""
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = self._by_rows[min(x2.shape[0], MAX_ROWS)](x2, self.stored)
        if out.shape[1] != self.out_features:  # a padded storage (blocked)
            out = out[:, : self.out_features].contiguous()
        return out.view(*x.shape[:-1], self.out_features)

    def streams(self, rows: int) -> bool:
        """Whether `rows` rows take the stream kernel on unpadded blocked storage (what
        `_cpu_kernels.layer` calls directly)."""
        return self._by_rows[min(rows, MAX_ROWS)] in STREAM_ARGS and self.out_features % BLOCK == 0

    def stream_args(self, rows: int) -> tuple[int, int]:
        """(gemm path, prefetch distance in bytes) of the stream call `rows` rows take ((0, 0): the plain stream,
        or not a stream call)."""
        return STREAM_ARGS.get(self._by_rows[min(rows, MAX_ROWS)], (0, 0))

    def plain(self) -> torch.Tensor:
        """-> [OUT, IN]: the weight in the checkpoint's layout (a copy for a packed storage; float32
        dequantized for int8)."""
        return STORAGES[self.storage].unpack(self.stored)[: self.out_features]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> [..., IN]: weight rows (the embedding lookup of a tied head)."""
        lookup = STORAGES[self.storage].rows
        if lookup is None:
            raise ValueError(f"a {self.storage!r} weight has no row access (tied embeddings need plain or transposed)")
        return lookup(self.stored, ids.reshape(-1)).reshape(*ids.shape, self.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held (oneDNN's blocked layout may pad: its own size, not OUT x IN)."""
        if self.stored.is_mkldnn:
            return int(torch.ops.mkldnn._nbytes(self.stored))
        return self.stored.untyped_storage().nbytes()

    def __repr__(self) -> str:
        return f"PackedLinear({list(self.shape)}, {self.dtype}, storage={self.storage}, calls={self.calls})"


def plain_weight(weight: "torch.Tensor | PackedLinear") -> torch.Tensor:
    """[OUT, IN] in the checkpoint's layout, whichever way the weight is held."""
    return weight.plain() if isinstance(weight, PackedLinear) else weight.detach()
