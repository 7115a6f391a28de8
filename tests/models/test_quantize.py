"""int8 and 4-bit weights: the quantization's error bound (and Q4_1 values coming back exactly), the blocked
storage round trip, and the stream kernel for each (integer dot products on x quantized to int8) against its
float64 reference, the same bits on every code path (AVX-512 VNNI, AVX2, portable C), with each row of a
many-row call equal to the same row alone (a verify must compute what a decode step does, bit for bit)."""

import pytest
import torch

from specrl.models.linear import BLOCK, CALLS, KIND, PackedLinear, cpu_kernels
from specrl.errors import InvalidRequestError
from specrl.models.calibration import cpu_info
from specrl.models.quantize import GROUP, Int8Weight, Q4Weight, matmul_reference, quantize_activations

pytestmark = pytest.mark.skipif(cpu_kernels is None, reason="the stream kernel is not built")


def _weight(out_features, in_features, seed=0):
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_quantization_error_is_at_most_half_a_step_of_its_group():
    w = _weight(64, 96)
    w[3, 32:64] = 0.0  # an all-zero group
    w[5, :32] *= 100  # a group far larger than the rest of its row: its scale is its own
    q = Int8Weight.from_float(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (64, 3) and q.q.abs().max() <= 127
    step = q.scale.repeat_interleave(GROUP, dim=1)
    assert torch.all((q.dequantize() - w).abs() <= step / 2 + 1e-9)
    assert torch.equal(q.q[3, 32:64], torch.zeros(32, dtype=torch.int8)) and q.scale[3, 1] == 1.0
    assert q.scale[5, 0] > 50 * q.scale[5, 1]
    assert q.q.view(64, 3, GROUP).abs().amax(2).min() == 0 and (q.q.view(64, 3, GROUP).abs().amax(2) == 127).sum() == 191


def test_weights_that_cannot_be_quantized_are_refused():
    w = _weight(16, 32)
    w[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        Int8Weight.from_float(w)
    with pytest.raises(InvalidRequestError, match="groups of 32"):
        Int8Weight.from_float(_weight(16, 48))


def test_q4_values_come_back_exactly_and_floats_within_half_a_step():
    """Q4_1's values (q * scale + minimum, float16 scale and minimum, groups holding q = 0 and 15, as llama.cpp
    quantizes) give back the same q, scales and minimums: SmolLM2's checkpoint is such values."""
    gen = torch.Generator().manual_seed(3)
    scale = (torch.rand(32, 3, generator=gen) * 0.01 + 1e-3).half()
    minimum = (-torch.rand(32, 3, generator=gen) * 0.05).half()
    q = torch.randint(0, 16, (32, 96), generator=gen, dtype=torch.uint8)
    q[:, ::GROUP], q[:, 1::GROUP] = 0, 15
    values = (q.float().view(32, 3, GROUP) * scale.float()[..., None] + minimum.float()[..., None]).view(32, 96)
    back = Q4Weight.from_float(values)
    assert torch.equal(back.q, q) and torch.equal(back.scale, scale) and torch.equal(back.minimum, minimum)
    w = _weight(32, 96)
    quantized = Q4Weight.from_float(w)
    step = quantized.scale.float().repeat_interleave(GROUP, dim=1)
    assert quantized.q.max() <= 15 and torch.all((quantized.dequantize() - w).abs() <= step / 2 + 2e-3 * step)
    with pytest.raises(InvalidRequestError, match="groups of 32"):
        Q4Weight.from_float(_weight(16, 48))


@pytest.mark.parametrize("shape", [(64, 96), (40, 32), (48, 64)])  # 40: padded to 48; 48: not whole groups of 4
def test_blocked_int8_round_trip_and_rows(shape):
    q = Int8Weight.from_float(_weight(*shape))
    packed = PackedLinear(q, "blocked", (1,), ("stream",))
    assert packed.dtype == torch.int8 and packed.stored.dtype == torch.int8
    assert packed.stored.shape == (-(-shape[0] // BLOCK), shape[1] + shape[1] // GROUP * 4, BLOCK)
    torch.testing.assert_close(packed.plain(), q.dequantize(), rtol=0, atol=0)
    ids = torch.tensor([0, shape[0] - 1, 7])
    torch.testing.assert_close(packed.rows(ids), q.dequantize()[ids], rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(64, 96), (40, 32), (48, 64)])
def test_blocked_q4_round_trip_and_rows(shape):
    q = Q4Weight.from_float(_weight(*shape))
    packed = PackedLinear(q, "blocked", (1,), ("stream",))
    assert packed.dtype == torch.quint4x2 and packed.stored.dtype == torch.uint8
    assert packed.stored.shape == (-(-shape[0] // BLOCK), 10 * shape[1])  # 0.625 bytes a weight
    torch.testing.assert_close(packed.plain(), q.dequantize(), rtol=0, atol=0)
    ids = torch.tensor([0, shape[0] - 1, 7])
    torch.testing.assert_close(packed.rows(ids), q.dequantize()[ids], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", [Int8Weight, Q4Weight])
def test_row_lookup_in_c_equals_the_torch_reference_and_refuses_ids_outside(fmt):
    """A tied head's embedding lookup (`_cpu_kernels.quant_rows`) dequantizes exactly what the torch reference
    (`_quantized_rows`, the path without the kernel) does, for any ids, repeats and order included; an id outside
    the weight's rows is an IndexError, never a read past it."""
    from specrl.models.linear import _quantized_rows

    if cpu_kernels is None:
        pytest.skip("the stream kernel is not built")
    packed = PackedLinear(fmt.from_float(_weight(80, 96, seed=3)), "blocked", (1,), ("stream",))
    ids = torch.tensor([0, 79, 17, 17, 5, 64, 31])
    want = _quantized_rows(packed.stored.index_select(0, ids // BLOCK), ids % BLOCK)
    assert torch.equal(packed.rows(ids), want)
    assert packed.rows(ids[None, :3]).shape == (1, 3, 96)
    for bad in (torch.tensor([80]), torch.tensor([3, -1])):
        with pytest.raises(IndexError):
            packed.rows(bad)


@pytest.mark.parametrize("fmt", [Int8Weight, Q4Weight])
@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (48, 64), (40, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 12, 13, 16, 17])  # every register tile's row count on each path
def test_stream_matches_the_reference_bit_for_bit_on_every_path(fmt, shape, rows):
    """int8 and 4-bit weights times x quantized to int8 per group (integer sums, then one fused multiply-add a
    group in one order): the best path (AVX-512 VNNI here, or AVX2), AVX2 forced, AMX-INT8 tiles (16 rows a tile:
    17 rows take two) and portable C give the same bits, each row of a many-row call equals the row alone, and all
    match the float64 reference."""
    q = fmt.from_float(_weight(*shape, seed=rows))
    packed = PackedLinear(q, "blocked", (1,), ("stream",))
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    x[0, :GROUP] = 0.0  # an all-zero group: dx = 0
    got = packed(x)
    torch.testing.assert_close(got, matmul_reference(x, q), atol=1e-5, rtol=1e-4)
    padded = packed.stored.shape[0] * BLOCK
    for path in (1, 3, 4):  # portable C, AVX2 (C where the CPU has no AVX2), AMX-INT8 (the best path where none)
        forced = torch.empty(rows, padded)
        cpu_kernels.gemm(forced.data_ptr(), x.data_ptr(), packed.stored.data_ptr(), rows, shape[1], padded,
                         KIND[packed.dtype], 2, path)
        assert torch.equal(forced[:, : shape[0]], got), path
    for row in {0, rows // 2, rows - 1}:  # each row as a one-row call computes it: bit for bit
        assert torch.equal(packed(x[row:row + 1].contiguous())[0], got[row])
    ahead = torch.empty(rows, padded)  # prefetching only reads ahead
    cpu_kernels.gemm(ahead.data_ptr(), x.data_ptr(), packed.stored.data_ptr(), rows, shape[1], padded,
                     KIND[packed.dtype], 2, 0, 2048)
    assert torch.equal(ahead[:, : shape[0]], got)


@pytest.mark.parametrize("rows", [1, 4, 5])
def test_the_largest_4bit_sums_stay_exact(rows):
    """AVX2 sums a group's 4-bit products in int16 before widening (_cpu_quant.c): at most 8 x 2 x 15 x 127 =
    30,480 a lane. Every weight at the top of its group's range (q = 15, one at 0 so the range is not empty) times
    every x at +-127 after rounding: the sums at that bound give the portable path's bits, in both signs."""
    w = torch.ones(64, 128)
    w[:, ::GROUP] = 0.0  # each group's minimum: q = 0 there, 15 everywhere else
    q = Q4Weight.from_float(w)
    assert int((q.q == 15).sum()) == 64 * 124 and int((q.q == 0).sum()) == 64 * 4
    packed = PackedLinear(q, "blocked", (1,), ("stream",))
    x = torch.ones(rows, 128)
    x[rows // 2:] = -1.0
    got = packed(x)
    forced = torch.empty(rows, 64)
    cpu_kernels.gemm(forced.data_ptr(), x.data_ptr(), packed.stored.data_ptr(), rows, 128, 64, KIND[packed.dtype], 1, 1)
    assert torch.equal(forced, got)
    torch.testing.assert_close(got, matmul_reference(x, q), atol=1e-4, rtol=1e-5)


def test_activations_are_quantized_per_group_of_32():
    """The kernel multiplies x rounded to int8 per group, not x: a value far below its group's largest
    rounds to zero, while the same value in a group of its own size is kept."""
    w = Int8Weight.from_float(torch.ones(16, 64))
    packed = PackedLinear(w, "blocked", (1,), ("stream",))
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 1000.0, 1.0  # 1.0 is under half a step (1000 / 127 / 2) of group 0
    x[0, 32] = 1.0  # group 1's own amax: exact
    assert torch.allclose(packed(x), torch.full((1, 16), 1001.0))
    xq, dx = quantize_activations(x)
    assert xq[0, 1] == 0 and xq[0, 0] == 127 and xq[0, 32] == 127 and dx[0, 1] == 1.0 / 127


def test_the_quantized_path_is_named():
    assert cpu_kernels.path(64, KIND[torch.int8]) in {"avx512_vnni", "avx2", "portable"}
    amx = cpu_kernels.path(64, KIND[torch.int8], 32, 4)  # AMX-INT8 tiles where the CPU has them
    assert amx == ("amx_int8" if {"amx_tile", "amx_int8"} <= cpu_info()[1] else cpu_kernels.path(64, KIND[torch.int8]))
    assert bool(CALLS["stream amx"].dtypes) == (amx == "amx_int8")  # the calibration's call only where it runs


def test_the_stream_call_takes_int8_and_4bit_weights_with_float32_inputs():
    assert {(torch.int8, torch.float32), (torch.quint4x2, torch.float32)} <= set(CALLS["stream"].dtypes)


@pytest.mark.parametrize("fmt", [Int8Weight, Q4Weight])
def test_bytes_per_weight_is_what_the_packed_storage_holds(fmt):
    from specrl.models.quantize import bytes_per_weight

    packed = PackedLinear(fmt.from_float(_weight(64, 96)), "blocked", (1,), ("stream",))
    assert packed.nbytes == 64 * 96 * bytes_per_weight(fmt.dtype)
