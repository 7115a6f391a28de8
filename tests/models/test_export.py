"""`specrl export-drafter --format vllm`: the EAGLE-1 files vLLM loads plus specrl's extras."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specrl.errors import IncompatibleDrafterError
from specrl.export import DRAFT_HEAD, DRAFT_TO_TARGET, EXTRA_FILE, INPUT_NORM, export_vllm
from specrl.models.drafter import EagleDrafter
from specrl.models.llama import load_llama


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_llama(tiny_dir)


@pytest.mark.parametrize("draft_vocab_size", [0, 64])
def test_export_writes_eagle_names_and_keeps_what_eagle1_has_no_place_for(target, tiny_dir, tmp_path, draft_vocab_size):
    drafter = EagleDrafter.day0(target, seed=1, draft_vocab_size=draft_vocab_size)
    drafter.set_feature_scale(torch.rand(target.cfg.hidden_size) + 0.5)
    drafter.save(tmp_path / "drafter")
    out = export_vllm(tmp_path / "drafter", tiny_dir, tmp_path / "eagle")
    tensors, extra = load_file(str(out / "model.safetensors")), load_file(str(out / EXTRA_FILE))
    h = target.cfg.hidden_size
    # fc reads the raw feature in vLLM: the scale is folded into its feature columns
    torch.testing.assert_close(tensors["fc.weight"][:, h:], drafter.fc[:, h:].detach() / drafter.feature_scale)
    assert "layers.0.self_attn.q_proj.weight" in tensors and INPUT_NORM not in tensors
    torch.testing.assert_close(extra[INPUT_NORM], drafter.layer.input_norm.detach())
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    if draft_vocab_size:
        torch.testing.assert_close(extra[DRAFT_HEAD], drafter.head.detach())
        assert extra[DRAFT_TO_TARGET].tolist() == list(range(draft_vocab_size))
    else:
        assert DRAFT_HEAD not in extra and DRAFT_TO_TARGET not in extra


def test_export_of_a_directory_without_a_drafter_is_refused(tiny_dir, tmp_path):
    with pytest.raises(IncompatibleDrafterError, match="is missing"):
        export_vllm(tmp_path, tiny_dir, tmp_path / "eagle")
