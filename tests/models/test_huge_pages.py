"""Packed weights moved into one mapping of 2 MB pages (specrl/models/huge_pages.py): the same values, one weight a
page range of its own, in order, and a prepared model reads them there."""

import gc
import mmap
from types import SimpleNamespace

import pytest
import torch

from specrl.models.huge_pages import ALIGN, HUGE_PAGE, move_into_huge_pages
from specrl.models.linear import PackedLinear, cpu_kernels
from specrl.models.llama import load_llama
from tests.models.test_prepared import ForcedPlan

needs_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this OS")


@needs_thp
def test_weights_keep_their_values_dtypes_and_shapes_in_one_aligned_mapping():
    g = torch.Generator().manual_seed(0)
    originals = [torch.randn(48, 64, generator=g), torch.randn(5000, generator=g).to(torch.bfloat16),
                 torch.randint(-127, 128, (3, 4096), generator=g, dtype=torch.int8),
                 torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8), torch.empty(0, 16)]
    weights = [SimpleNamespace(stored=t.clone()) for t in originals]
    assert move_into_huge_pages(weights)
    for w, t in zip(weights, originals):
        assert w.stored.dtype == t.dtype and w.stored.shape == t.shape and torch.equal(w.stored, t)
    placed = [w.stored.data_ptr() for w in weights[:4]]
    assert placed[0] % HUGE_PAGE == 0 and all(p % ALIGN == 0 for p in placed)
    sizes = [t.numel() * t.element_size() for t in originals[:4]]
    for (p, n), q in zip(zip(placed, sizes), placed[1:]):  # one after another, each on pages of its own
        assert p + n <= q < p + n + ALIGN
    gc.collect()  # the mapping lives as long as its copies do
    weights[2].stored.add_(1)
    assert torch.equal(weights[2].stored, originals[2] + 1) and torch.equal(weights[0].stored, originals[0])


@needs_thp
def test_tensors_it_cannot_move_stay_where_they_are():
    strided = SimpleNamespace(stored=torch.randn(8, 8).t())
    before = strided.stored
    assert not move_into_huge_pages([strided]) and strided.stored is before
    assert not move_into_huge_pages([])


@pytest.mark.skipif(cpu_kernels is None, reason="the stream kernel is not built")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.quint4x2])
def test_a_prepared_model_streams_from_the_mapping_and_computes_the_same_bits(tiny_dir, weight_dtype, monkeypatch):
    """prepare_inference moves every streamed weight there (where the OS offers huge pages); a forward through the C
    layer loop reading them equals, bit for bit, a forward of the same model prepared without the move."""
    import specrl.models.llama as llama

    plan = ForcedPlan("blocked", torch.float32, weight_dtype)
    model = load_llama(tiny_dir, plan=plan)
    weights = [w for w in model.streamed_weights() if isinstance(w, PackedLinear)]
    assert len(weights) == len(model.streamed_weights())
    monkeypatch.setattr(llama, "move_into_huge_pages", lambda weights: False)
    unmoved = load_llama(tiny_dir, plan=plan)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        first = weights[0].stored.data_ptr()
        in_mapping = [first <= w.stored.data_ptr() < first + 64 * HUGE_PAGE for w in weights + unmoved.streamed_weights()]
        assert first % HUGE_PAGE == 0 and in_mapping == [True] * len(weights) + [False] * len(weights)
    tokens, slots, start = torch.tensor([[3, 17, 5], [9, 2, 40]]), torch.tensor([0, 1]), torch.tensor([4, 7])
    with torch.inference_mode():
        moved = model(tokens, slots, start, model.new_cache(2, 16))
        ordinary = unmoved(tokens, slots, start, unmoved.new_cache(2, 16))
        one = model(torch.tensor([[11]]), torch.tensor([0]), torch.tensor([7]), model.new_cache(2, 16))
        one_ordinary = unmoved(torch.tensor([[11]]), torch.tensor([0]), torch.tensor([7]), unmoved.new_cache(2, 16))
    assert torch.equal(moved, ordinary) and torch.equal(one, one_ordinary)
    assert torch.equal(model.logits(moved), unmoved.logits(ordinary))
