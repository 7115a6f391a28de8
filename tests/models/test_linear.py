"""Every linear call gives F.linear's result from its storage; a PackedLinear keeps one copy."""

import pytest
import torch
import torch.nn.functional as F

from specrl.models.linear import CALLS, STORAGES, PackedLinear, calls_for, linear, plain_weight

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.1, rtol=0.02)}


def _storage_or_skip(name: str, weight: torch.Tensor) -> torch.Tensor:
    try:
        return STORAGES[name].pack(weight)
    except RuntimeError as exc:  # oneDNN bf16 packing needs AVX-512 or AVX-NE-CONVERT
        pytest.skip(f"{name} storage for {weight.dtype} is not available on this CPU: {exc}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("call,rows", [(c, r) for c in sorted(CALLS) for r in (1, 2, 5, 17, 64) if r <= CALLS[c].max_rows])
def test_every_call_matches_f_linear(call, rows, dtype):
    spec = CALLS[call]
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    stored = _storage_or_skip(spec.storage, weight)
    out = spec.fn(x, stored)
    assert out.shape == (rows, 96) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), **TOL[dtype])


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
