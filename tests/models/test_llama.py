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


@pytest.mark.parametrize("prepared", [False, True])
def test_rows_of_different_lengths_compute_what_each_row_would_alone(tiny_dir, home, prepared):
    """A verify batch whose rows draft different numbers of tokens: every linear runs on the real
    tokens only, padding is never written to the cache, and a row padded past the end of its
    context is fine."""
    from specrl.models.calibration import Calibration

    model = load_llama(tiny_dir, plan=Calibration.open(home / "calibration") if prepared else None)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 4), generator=gen)
    start, slots, max_len = torch.tensor([5, 27]), torch.tensor([0, 1]), 28  # row 1 has room for one token
    packed_cache, alone_cache = model.new_cache(2, max_len), model.new_cache(2, max_len)
    for cache in (packed_cache, alone_cache):
        context = torch.randint(0, model.cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
        model(context, slots, torch.zeros(2, dtype=torch.long), cache)
        model(torch.zeros(1, 22, dtype=torch.long), slots[1:], torch.tensor([5]), cache)  # row 1 up to position 26
    with torch.inference_mode():
        packed = model(tokens, slots, start, packed_cache, torch.tensor([4, 1]))
        row0 = model(tokens[:1], slots[:1], start[:1], alone_cache)
        row1 = model(tokens[1:, :1], slots[1:], start[1:], alone_cache)
    torch.testing.assert_close(packed[0], row0[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[1, :1], row1[0], rtol=1e-4, atol=1e-4)
    assert (packed[1, 1:] == 0).all()
    torch.testing.assert_close(packed_cache.k.float(), alone_cache.k.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (2, 3, 64), (0, 64)])
def test_fused_rms_norm_equals_the_torch_ops_and_keeps_autograd(shape):
    from specrl.models.linear import cpu_kernels
    from specrl.models.llama import rms_norm

    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    gen = torch.Generator().manual_seed(0)
    x, weight = 3 * torch.randn(shape, generator=gen), torch.randn(shape[-1], generator=gen)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    with torch.inference_mode():
        got = rms_norm(x, weight, 1e-5)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    leaf = weight.clone().requires_grad_()
    rms_norm(x, leaf, 1e-5).sum().backward()  # training takes the ops: gradients flow
    assert leaf.grad is not None and leaf.grad.shape == weight.shape


def _attention_case(head_dim, gen):
    """A cache with history in every slot, and a verify-like batch: non-consecutive slots, rows at
    different positions and of different lengths (one padded row)."""
    from specrl.models.kv_cache import CacheBatch, KVCache
    from specrl.models.llama import Rope

    nh, kvh, max_len = 6, 2, 160
    cache = KVCache(2, 5, max_len, kvh, head_dim)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    rope = Rope(head_dim, 10000.0, max_len)
    slots, start, lengths = torch.tensor([3, 0, 4]), torch.tensor([7, 64, 150]), torch.tensor([5, 2, 5])
    batch = CacheBatch(cache, slots, start, 5, lengths)
    n = int(lengths.sum())
    qkv = torch.randn(n, (nh + 2 * kvh) * head_dim, generator=gen)
    return cache, batch, rope, qkv, nh, kvh


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("head_dim", [64, 16])  # the unrolled D = 64 instance, and any other D
def test_fused_attention_equals_the_torch_ops(head_dim, portable):
    """The C kernel's rotation, cache writes and attention (packed rows of different lengths,
    scattered slots) against apply_rope + CacheBatch.attend on the same inputs."""
    import copy

    from specrl.models.llama import apply_rope
    from specrl.models.linear import cpu_kernels

    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    cache, batch, rope, qkv, nh, kvh = _attention_case(head_dim, torch.Generator().manual_seed(5))
    assert batch.fused and batch.rows is not None
    reference_cache = copy.deepcopy(cache)
    cos, sin = rope.tables(batch.positions)
    bsz, t = batch.positions.shape
    padded = qkv.new_zeros(bsz * t, qkv.shape[1]).index_copy_(0, batch.rows, qkv).view(bsz, t, nh + 2 * kvh, head_dim)
    qk = apply_rope(padded[:, :, : nh + kvh], cos, sin)
    from specrl.models.kv_cache import CacheBatch

    reference_batch = CacheBatch(reference_cache, batch.slots, batch.positions[:, 0], t, torch.tensor([5, 2, 5]))
    want = reference_batch.attend(1, qk[:, :, :nh], qk[:, :, nh:], padded[:, :, nh + kvh:])
    want = want.reshape(bsz * t, -1).index_select(0, batch.rows)
    got = batch.attend_fused(1, qkv.clone(), cos, sin, nh, portable=portable)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k, reference_cache.k, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(cache.v, reference_cache.v, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 16])
def test_fused_attention_of_a_token_does_not_depend_on_the_step_length(head_dim):
    """Five tokens in one verify call attend exactly (bit for bit) as five one-token decode steps:
    greedy speculation then computes the tokens plain decoding would."""
    from specrl.models.kv_cache import CacheBatch
    from specrl.models.linear import cpu_kernels

    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    cache, _, rope, _, nh, kvh = _attention_case(head_dim, torch.Generator().manual_seed(6))
    qkv = torch.randn(5, (nh + 2 * kvh) * head_dim, generator=torch.Generator().manual_seed(7))
    slot, start = torch.tensor([2]), 90
    verify = CacheBatch(cache, slot, torch.tensor([start]), 5)
    together = verify.attend_fused(0, qkv.clone(), *rope.tables(verify.positions), nh)
    steps = []
    for i in range(5):
        step = CacheBatch(cache, slot, torch.tensor([start + i]), 1)
        steps.append(step.attend_fused(0, qkv[i: i + 1].clone(), *rope.tables(step.positions), nh))
    assert torch.equal(together, torch.cat(steps))


def test_fused_attention_of_packed_rows_does_not_depend_on_the_thread_count():
    """Rows of unequal length (5, 2, 5 tokens): the kernel hands (sequence, head) tasks to threads
    as they free up, and each task's output is bit for bit the same on 1, 2 or 3 threads (each call
    writes the same keys and values to the cache again)."""
    from specrl.models.linear import cpu_kernels

    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    cache, batch, rope, qkv, nh, _ = _attention_case(64, torch.Generator().manual_seed(8))
    cos, sin = rope.tables(batch.positions)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(batch.attend_fused(1, qkv.clone(), cos, sin, nh))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


@pytest.mark.parametrize("shape", [(3, 49152), (2, 4, 1000), (5, 31), (1, 1), (0, 64)])  # tails past the 32-wide loop
def test_argmax_equals_torchs_first_index_on_ties(shape):
    from specrl.models.linear import cpu_kernels
    from specrl.models.llama import argmax

    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    ties = torch.round(x * 2) / 2  # many equal maxima: the first index wins
    late = x.clone()
    late[..., -1] = late.abs().sum() + 1  # the max in the scalar tail
    for logits in (x, ties, late):
        assert torch.equal(argmax(logits), logits.argmax(-1))
        rows = logits.numel() // shape[-1]
        portable = torch.empty(rows, dtype=torch.long)
        cpu_kernels.argmax_rows(portable.data_ptr(), logits.data_ptr(), rows, shape[-1], True)
        assert torch.equal(portable, logits.reshape(rows, shape[-1]).argmax(-1))


@pytest.mark.parametrize("shape", [(1, 3072), (5, 3072), (2, 3, 70), (0, 64)])  # 70: a tail past the 8-lane loop
def test_fused_silu_mul_equals_the_torch_ops_and_keeps_autograd(shape):
    import torch.nn.functional as F

    from specrl.models.linear import cpu_kernels
    from specrl.models.llama import silu_mul

    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    gate_up = 6 * torch.randn(shape, generator=torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    with torch.inference_mode():
        got = silu_mul(gate_up)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    portable = torch.empty_like(want)
    cpu_kernels.silu_mul(portable.data_ptr(), gate_up.data_ptr(), gate_up.numel() // shape[-1], shape[-1] // 2, True)
    torch.testing.assert_close(portable, want, atol=1e-5, rtol=1e-5)
    leaf = gate_up.clone().requires_grad_()
    silu_mul(leaf).sum().backward()  # training takes the ops: gradients flow
    assert leaf.grad is not None and leaf.grad.shape == gate_up.shape


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", [None, [3, 1]])  # equal rows, and a packed verify
def test_one_call_layer_computes_the_per_op_path_to_the_bit(weight_dtype, lengths):
    """A decoder layer whose linears all stream runs as one `_cpu_kernels.layer` call; it must give
    what the per-op path (the same kernels called from Python) gives, bit for bit, cache included."""
    import copy

    from specrl.models.kv_cache import CacheBatch, KVCache
    from specrl.models.linear import MAX_ROWS, PackedLinear, cpu_kernels
    from specrl.models.llama import DecoderLayer, LlamaConfig, Rope

    if cpu_kernels is None:
        pytest.skip("the C kernels are not built")
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=192, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(8)
    layer = DecoderLayer(cfg)
    with torch.no_grad():
        for name in DecoderLayer.LINEARS:
            weight = torch.randn(getattr(layer, name).shape, generator=gen) * 0.05
            packed = PackedLinear(weight.to(weight_dtype), "blocked", (MAX_ROWS,), ("stream",))
            layer._parameters.pop(name)
            object.__setattr__(layer, name, packed)
        layer.input_norm.copy_(1 + 0.1 * torch.randn(128, generator=gen))
        layer.post_norm.copy_(1 + 0.1 * torch.randn(128, generator=gen))
    rope = Rope(64, 10000.0, 64)
    cache = KVCache(2, 3, 64, 2, 64)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    per_op_cache = copy.deepcopy(cache)
    slots, start = torch.tensor([2, 0]), torch.tensor([9, 30])
    lens = None if lengths is None else torch.tensor(lengths)
    rows = 6 if lengths is None else sum(lengths)
    x = torch.randn(rows if lengths else 2, *(() if lengths else (3,)), 128, generator=gen)
    with torch.inference_mode():
        batch = CacheBatch(cache, slots, start, 3, lens)
        cos, sin = rope.tables(batch.positions)
        assert layer.streams(x) and batch.fused
        got = layer(x, cos, sin, batch, 1)
        per_op_batch = CacheBatch(per_op_cache, slots, start, 3, lens)
        layer.streams = lambda x: False  # the per-op path, for comparison
        want = layer(x, cos, sin, per_op_batch, 1)
    assert torch.equal(got, want)
    assert torch.equal(cache.k, per_op_cache.k) and torch.equal(cache.v, per_op_cache.v)
