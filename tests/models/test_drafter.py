import json

import pytest
import torch

from specrl.errors import IncompatibleDrafterError
from specrl.models.drafter import CONFIG_FILE, DrafterConfig, EagleDrafter, frequency_vocabulary
from specrl.models.llama import load_llama


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_llama(tiny_dir)


def test_save_load_roundtrip_gives_same_outputs(target, tmp_path):
    drafter = EagleDrafter.day0(target, seed=3)
    drafter.save(tmp_path)
    loaded = EagleDrafter.load(tmp_path, target)
    feats, toks = torch.randn(2, 5, target.cfg.hidden_size), torch.randint(0, 500, (2, 5))
    with torch.inference_mode():
        torch.testing.assert_close(loaded.logits(loaded(feats, toks)), drafter.logits(drafter(feats, toks)))


def test_cached_forward_matches_uncached(target):
    """Drafting step by step through the KV cache equals one causal pass (training form)."""
    drafter = EagleDrafter.day0(target)
    feats, toks = torch.randn(1, 6, target.cfg.hidden_size), torch.randint(0, 500, (1, 6))
    cache = drafter.new_cache(2, 16)
    with torch.inference_mode():
        full = drafter(feats, toks)
        first = drafter(feats[:, :4], toks[:, :4], torch.tensor([1]), torch.tensor([0]), cache)
        rest = [drafter(feats[:, i:i + 1], toks[:, i:i + 1], torch.tensor([1]), torch.tensor([i]), cache) for i in (4, 5)]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, atol=1e-5, rtol=0)


def test_reduced_vocabulary_maps_to_target_ids(target):
    cfg = DrafterConfig.for_target(target.cfg, draft_vocab_size=100)
    drafter = EagleDrafter(cfg, target)
    assert drafter.logits(torch.zeros(3, target.cfg.hidden_size)).shape == (3, 100)
    drafter.draft_to_target.copy_(torch.arange(100) * 7)
    assert drafter.to_target_ids(torch.tensor([0, 5, 99])).tolist() == [0, 35, 693]


def test_day0_reduced_vocabulary_is_the_targets_head_over_the_first_ids(target):
    drafter = EagleDrafter.day0(target, draft_vocab_size=64)
    hidden = torch.randn(3, target.cfg.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(drafter.logits(hidden), target.logits(hidden)[:, :64])
    ids = torch.tensor([0, 5, 63])
    assert drafter.to_draft_ids(drafter.to_target_ids(ids)).tolist() == ids.tolist()
    assert drafter.to_draft_ids(torch.tensor([64, 1000])).tolist() == [-1, -1]  # outside: no draft id


def test_day0_named_vocabulary_is_the_targets_head_over_those_ids(target, tmp_path):
    ids = torch.tensor([900, 3, 17, 500, 42])
    drafter = EagleDrafter.day0(target, draft_vocab_size=64, vocabulary=ids)  # the size follows the ids
    assert drafter.cfg.draft_vocab_size == 5 and drafter.draft_to_target.tolist() == ids.tolist()
    hidden = torch.randn(3, target.cfg.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(drafter.logits(hidden), target.logits(hidden)[:, ids])
    assert drafter.to_draft_ids(torch.tensor([17, 900, 4])).tolist() == [2, 0, -1]
    drafter.save(tmp_path)  # the map travels with the weights
    assert EagleDrafter.load(tmp_path, target).draft_to_target.tolist() == ids.tolist()


@pytest.mark.parametrize("ids", [[1, 1, 2], [-1, 4], [10 ** 6], []])
def test_day0_vocabulary_of_bad_ids_is_refused(target, ids):
    with pytest.raises(ValueError, match="distinct int64 token ids"):
        EagleDrafter.day0(target, vocabulary=torch.tensor(ids, dtype=torch.long))


def test_frequency_vocabulary_ranks_by_count_then_id():
    counts = torch.tensor([0, 5, 2, 5, 0, 9, 1])
    assert frequency_vocabulary(counts, 3).tolist() == [5, 1, 3]  # 1 and 3 tie: the lower id first
    assert frequency_vocabulary(counts, 7).tolist() == [5, 1, 3, 2, 6, 0, 4]  # unseen ids fill up in id order
    for size in (0, 8):
        with pytest.raises(ValueError, match="1..7"):
            frequency_vocabulary(counts, size)


@pytest.mark.parametrize("size", [0, 10 ** 6])
def test_day0_full_vocabulary_uses_the_targets_head(target, size):
    drafter = EagleDrafter.day0(target, draft_vocab_size=size)
    assert drafter.head is None and drafter.cfg.draft_vocab_size == target.cfg.vocab_size


def test_negative_draft_vocabulary_is_refused(target):
    with pytest.raises(ValueError, match="draft_vocab_size must be >= 0"):
        EagleDrafter.day0(target, draft_vocab_size=-1)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 32, "hidden_size=32 does not fit"),
    ("vocab_size", 1000, "vocab_size=1000 does not fit"),
    ("draft_vocab_size", 0, "draft_vocab_size=0"),
    ("architecture", "medusa", "architecture 'medusa'"),
])
def test_drafter_that_does_not_fit_is_refused(target, tmp_path, field, value, message):
    EagleDrafter.day0(target).save(tmp_path)
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    cfg[field] = value
    (tmp_path / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(IncompatibleDrafterError, match=message):
        EagleDrafter.load(tmp_path, target)


def test_directory_without_drafter_files_is_refused(target, tmp_path):
    with pytest.raises(IncompatibleDrafterError, match="is not a drafter"):
        EagleDrafter.load(tmp_path, target)


def test_feature_scale_changes_conditioning_not_outputs(target):
    drafter = EagleDrafter.day0(target, seed=1)
    feats, toks = torch.randn(1, 4, target.cfg.hidden_size) * 50, torch.randint(0, 500, (1, 4))
    with torch.inference_mode():
        before = drafter(feats, toks)
    drafter.set_feature_scale(torch.rand(target.cfg.hidden_size) * 100 + 1)
    with torch.inference_mode():
        torch.testing.assert_close(drafter(feats, toks), before, atol=1e-3, rtol=1e-4)
