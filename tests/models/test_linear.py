"""Every linear call gives F.linear's result from its storage; a PackedLinear keeps one copy."""

import pytest
import torch
import torch.nn.functional as F

from specrl.models.calibration import convert
from specrl.models.linear import CALLS, STORAGES, PackedLinear, calls_for, linear, plain_weight
from specrl.models.quantize import QUANTIZED, matmul_reference

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-4, rtol=1e-4),
       torch.bfloat16: dict(atol=0.1, rtol=0.02)}


def _storage_or_skip(name: str, weight: torch.Tensor) -> torch.Tensor:
    try:
        return STORAGES[name].pack(weight)
    except RuntimeError as exc:  # oneDNN bf16 packing needs AVX-512 or AVX-NE-CONVERT
        pytest.skip(f"{name} storage for {weight.dtype} is not available on this CPU: {exc}")


@pytest.mark.parametrize("call,rows,dtypes", [(c, r, d) for c in sorted(CALLS) for r in (1, 2, 5, 17, 64)
                                               for d in CALLS[c].dtypes if r <= CALLS[c].max_rows])
def test_every_call_matches_f_linear(call, rows, dtypes):
    """Every call, at every (weight, x) dtype pair it takes, against F.linear in float32 over the same
    values (bf16 on either side: bf16's tolerance; the bf16 calls round x to bf16)."""
    spec = CALLS[call]
    weight_dtype, x_dtype = dtypes
    gen = torch.Generator().manual_seed(rows)
    weight = convert(torch.randn(96, 64, generator=gen), weight_dtype)  # int8: quantized, with its scales
    x = torch.randn(rows, 64, generator=gen).to(x_dtype)
    stored = _storage_or_skip(spec.storage, weight)
    out = spec.fn(x, stored)
    assert out.shape == (rows, 96) and out.dtype == x_dtype and out.is_contiguous()
    tol = TOL[torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32 if weight_dtype == x_dtype else torch.float16]
    # int8 and 4-bit weights multiply x rounded to int8 per group (quantize.matmul_reference)
    want = matmul_reference(x, weight) if isinstance(weight, QUANTIZED) else F.linear(x.float(), weight.float())
    torch.testing.assert_close(out.float(), want, **tol)


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_storage_unpacks_to_the_plain_weight(storage):
    weight = torch.randn(24, 16)
    packed = PackedLinear(weight.clone(), storage, (1, 512), tuple(c.name for c in (calls_for(storage, 1)[-1],
                                                                                      calls_for(storage, 2)[0])))
    assert torch.equal(packed.plain(), weight)
    ids = torch.tensor([[3, 0], [23, 3]])
    if STORAGES[storage].rows is None:
        with pytest.raises(ValueError, match="no row access"):
            packed.rows(ids)
    else:
        assert torch.equal(packed.rows(ids), weight[ids])


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_packed_linear_holds_one_copy(storage):
    """The PackedLinear's bytes are one weight's, and the plain weight it was built from is not
    kept alive by it. (oneDNN's blocked layout pads OUT to its block: 200 rows hold 256; the
    model's shapes are multiples of 64, SmolLM2's pad nothing.)"""
    weight = torch.randn(192, 48)
    packed = PackedLinear(weight, storage, (512,), (calls_for(storage, 2)[0].name,))
    assert weight.nbytes <= packed.nbytes <= 1.02 * weight.nbytes
    odd = PackedLinear(torch.randn(200, 48), storage, (512,), (calls_for(storage, 2)[0].name,))
    assert 200 * 48 * 4 <= odd.nbytes <= 256 * 48 * 4
    held = packed.stored if not packed.stored.is_mkldnn else None
    if held is not None and storage != "plain":
        assert held.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()


def test_packed_linear_uses_the_call_of_each_bucket():
    weight = torch.randn(32, 8)
    packed = PackedLinear(weight, "plain", (1, 4, 16), ("mv", "W@x.T", "F.linear"))
    assert [packed.calls[b] for b in (1, 4, 16)] == ["mv", "W@x.T", "F.linear"]
    for rows in (1, 3, 4, 9, 600):  # rows above the last bucket use its call
        x = torch.randn(2, rows, 8) if rows % 2 == 0 else torch.randn(rows, 8)
        torch.testing.assert_close(linear(x, packed), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not all work from storage"):
        PackedLinear(weight, "transposed", (1,), ("mv",))


def test_plain_linear_is_unchanged_for_training():
    """A plain Parameter still backpropagates (the trainers' path)."""
    weight = torch.nn.Parameter(torch.randn(6, 4))
    x = torch.randn(3, 4, requires_grad=True)
    linear(x, weight).sum().backward()
    assert weight.grad is not None and x.grad is not None
    assert torch.equal(plain_weight(weight), weight.detach())


# ---- the stream kernel (specrl/models/_cpu_kernels.c) ---------------------------------------------

stream_kernel = pytest.importorskip("specrl.models._cpu_kernels", reason="the stream kernel is not built")


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out_features,in_features", [(128, 40), (48, 37), (40, 64)])  # 16-, 8-lane; padded
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12, 13, 64, 512])
def test_stream_matches_f_linear(out_features, in_features, rows, weight_dtype):
    """Every register tile (1..6 rows, and full tiles + remainder), both vector paths on AVX-512
    (groups of four 16-lane vectors where OUT/16 divides by 4, 8-lane ones otherwise), padding,
    and float16 weights computed in float32 (against F.linear over the same float16 values)."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    x = torch.randn(rows, in_features, generator=gen)
    packed = PackedLinear(weight, "blocked", (512,), ("stream",))
    out = packed(x)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight.float()), atol=1e-4, rtol=1e-4)


def test_stream_gives_the_same_bits_on_any_thread_count():
    """Each output is one thread's sum over K in order: the thread count cannot change a bit."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(256, 96, generator=gen), torch.randn(5, 96, generator=gen)
    packed = PackedLinear(weight, "blocked", (512,), ("stream",))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x)
        torch.set_num_threads(2)
        two = packed(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_rows_values_do_not_depend_on_the_rows_beside_it(weight_dtype):
    """A verify over many rows must compute each row as a one-row decode step does, to the bit
    (else greedy speculation could pick another token than plain decoding), whichever register
    tiles the row count takes (6 x 4 up to 6 rows, 12 x 2 tiles and a remainder beyond)."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(128, 96, generator=gen).to(weight_dtype)
    packed = PackedLinear(weight, "blocked", (512,), ("stream",))
    x = torch.randn(40, 96, generator=gen)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 6, 7, 8, 11, 12, 13, 16, 24, 25, 40):
        assert torch.equal(packed(x[:rows]), alone[:rows]), rows


def test_stream_refuses_what_does_not_fit():
    weight = STORAGES["blocked"].pack(torch.randn(32, 16))
    with pytest.raises(ValueError, match="does not fit"):
        CALLS["stream"].fn(torch.randn(2, 15), weight)  # IN differs
    with pytest.raises(ValueError, match="does not fit"):
        CALLS["stream"].fn(torch.randn(2, 16, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        STORAGES["blocked"].pack(torch.randn(32, 16).double())
    with pytest.raises(RuntimeError, match="pairs of inputs"):
        STORAGES["blocked"].pack(torch.randn(32, 15).bfloat16())


@pytest.mark.parametrize("path", ["best", "no_amx", "portable"])
@pytest.mark.parametrize("out_features,in_features", [(128, 64), (64, 96), (48, 38)])  # AMX; K % 32 != 0; odd blocks
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 40])
def test_stream_bf16_matches_the_rounded_product(out_features, in_features, rows, path):
    """bfloat16 weights: every path (AMX tiles of 16 rows and a partial group, AVX512-BF16 register
    tiles, portable C; a CPU without the path falls back to the next) gives x rounded to bfloat16
    times the weights, summed in float32: products of two bf16 values are exact, so only the order
    of the sums may differ."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen)
    stored = STORAGES["blocked"].pack(weight)
    out = torch.empty(rows, stored.shape[0] * 16)
    stream_kernel.gemm(out.data_ptr(), x.data_ptr(), stored.data_ptr(), rows, in_features, out.shape[1], 2, 2,
                       {"best": 0, "portable": 1, "no_amx": 2}[path])
    want = F.linear(x.bfloat16().double(), weight.double()).float()
    torch.testing.assert_close(out[:, :out_features], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(PackedLinear(weight, "blocked", (512,), ("stream",))(x), out[:, :out_features]) or path != "best"


def test_stream_uses_a_vector_path_where_the_cpu_has_one():
    from specrl.models.calibration import cpu_info

    flags = cpu_info()[1]
    path = stream_kernel.path(64)
    if "avx512f" in flags:  # groups of four 16-lane vectors where OUT/16 divides by 4, else 8-lane ones
        assert path == "avx512f" and stream_kernel.path(48) == "avx2"
    elif {"avx2", "fma", "f16c"} <= flags:
        assert path == "avx2"
    else:
        assert path == "portable"


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
def test_the_portable_path_matches_the_vector_path(weight_dtype):
    """The C path a CPU without AVX2 takes (forced here), against this CPU's path."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 40, generator=gen).to(weight_dtype)
    stored = STORAGES["blocked"].pack(weight)
    for rows in (1, 7, 20):
        x = torch.randn(rows, 40, generator=gen)
        out = torch.empty(rows, 96)
        stream_kernel.gemm(out.data_ptr(), x.data_ptr(), stored.data_ptr(), rows, 40, 96,
                           0 if weight_dtype == torch.float32 else 1, 1, True)
        torch.testing.assert_close(out, CALLS["stream"].fn(x, stored), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, F.linear(x, weight.float()), atol=1e-4, rtol=1e-4)
