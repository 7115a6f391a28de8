"""The target runtime matches transformers' LlamaForCausalLM on the same weights.

Tolerance: fp32 on CPU, different matmul calls and op order -> absolute logit difference
below 2e-4 for the tiny model (logits of magnitude ~10) and 1e-3 for SmolLM2 (magnitude ~30).
"""

import pytest
import torch
from transformers import LlamaForCausalLM

from specrl.models.llama import Llama, WeightsMismatch, load_llama


def _compare(model_dir, atol):
    ours = load_llama(model_dir)
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ours.cfg.vocab_size, (3, 17), generator=gen)
    more = torch.randint(0, ours.cfg.vocab_size, (3, 5), generator=gen)
    cache = ours.new_cache(num_slots=6, max_len=64)
    slots = torch.tensor([4, 1, 2])  # not consecutive: exercises the gathered read
    with torch.inference_mode():
        expected = ref(torch.cat([prompt, more], 1)).logits
        # batched prefill of the prompt, then a 5-token verify-style forward, then 1-token decodes
        prefill = ours.logits(ours(prompt, slots, torch.zeros(3, dtype=torch.long), cache))
        verify = ours.logits(ours(more[:, :4], slots, torch.full((3,), 17), cache))
        decode = ours.logits(ours(more[:, 4:], slots, torch.full((3,), 21), cache))
    torch.testing.assert_close(prefill, expected[:, :17], atol=atol, rtol=0)
    torch.testing.assert_close(verify, expected[:, 17:21], atol=atol, rtol=0)
    torch.testing.assert_close(decode, expected[:, 21:], atol=atol, rtol=0)


def test_tiny_logits_match_transformers(tiny_dir):
    _compare(tiny_dir, atol=2e-4)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm_dir):
    _compare(smollm_dir, atol=1e-3)


def test_rows_at_different_positions_do_not_see_each_other(tiny_dir):
    """Two sequences in one batch at different lengths give the logits each gets alone."""
    model = load_llama(tiny_dir)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 1000, (1, 9), generator=gen), torch.randint(0, 1000, (1, 4), generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(2, 32)
        model(a[:, :8], torch.tensor([0]), torch.tensor([0]), cache)
        model(b[:, :3], torch.tensor([1]), torch.tensor([0]), cache)
        together = model.logits(model(torch.cat([a[:, 8:], b[:, 3:]]), torch.tensor([0, 1]), torch.tensor([8, 3]), cache))
        alone = model.logits(model(b, torch.tensor([0]), torch.tensor([0]), model.new_cache(1, 32)))[:, -1:]
    torch.testing.assert_close(together[1:], alone, atol=1e-4, rtol=0)


def test_bad_checkpoint_changes_nothing(tiny_dir):
    from safetensors.torch import load_file

    model = load_llama(tiny_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :-1]
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] * 0  # would be copied first
    with pytest.raises(WeightsMismatch, match="down"):
        model.load_hf_state(tensors)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_tied_head_shares_the_embedding(tiny_dir):
    model = load_llama(tiny_dir)
    assert isinstance(model, Llama) and model.cfg.tie_word_embeddings
    assert model.lm_head.data_ptr() == model.embed.data_ptr()


def test_hf_state_roundtrips(tiny_dir):
    from safetensors.torch import load_file

    model = load_llama(tiny_dir)
    original = load_file(str(tiny_dir / "model.safetensors"))
    exported = model.hf_state()
    assert set(exported) == {k for k in original if k != "lm_head.weight"}
    for name, value in exported.items():
        assert torch.equal(value, original[name]), name
