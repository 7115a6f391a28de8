"""The inference form (`load_llama(dir, plan)`, `prepare_inference`) computes what the plain form does.

Tolerances: fp32, different matmul calls -> below 1e-4 on the tiny model's logits (magnitude ~10);
bf16 weights (x rounded to bf16 at the matmuls; fp32 accumulation) or all of bf16 (weights,
activations and KV cache: the plain form can) -> below 0.15 there; against HF on SmolLM2 see below.
"""

import pytest
import torch

from specrl.models.calibration import HEAD_BUCKETS, BUCKETS, Calibration, Choice
from specrl.models.drafter import EagleDrafter
from specrl.models.linear import STORAGES, PackedLinear, cpu_kernels
from specrl.models.llama import load_llama


class ForcedPlan(Calibration):
    """A calibration that packs every weight in one storage (tied heads: plain), to test each path."""

    def __init__(self, storage: str, dtype: torch.dtype = torch.float32, weight_dtype: torch.dtype | None = None):
        super().__init__(path=None, dtype=dtype, note="forced", key={}, weight_dtype=weight_dtype)
        self.storage = storage

    def choose(self, shape, *, head=False, tied=False):
        storage = "plain" if tied and STORAGES[self.storage].rows is None else self.storage
        buckets = HEAD_BUCKETS if head else BUCKETS
        calls = {"plain": ("mv",) + ("W@x.T",) * 7 + ("F.linear",) * (len(buckets) - 8),
                 "transposed": ("mv Wt",) + ("x@Wt",) * (len(buckets) - 1),
                 "onednn": ("onednn",) * len(buckets),
                 "blocked": ("stream",) * len(buckets)}[storage]
        return Choice(storage, buckets, calls, {storage: 1.0}, {storage: 0.0})


def _forwards(model, steps):
    """Prefill 2 rows (non-consecutive slots), verify T=4 at different starts, decode T=1 at one
    start (consecutive slots, one length: the unmasked slice path) and at different ones."""
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(num_slots=4, max_len=48)
    out = []
    with torch.inference_mode():
        for slots, start, t in steps:
            tokens = torch.randint(0, model.cfg.vocab_size, (len(slots), t), generator=gen)
            out.append(model.logits(model(tokens, torch.tensor(slots), torch.tensor(start), cache)))
    return out


STEPS = [([3, 1], [0, 0], 9), ([3, 1], [9, 9], 4), ([1, 3], [13, 13], 1), ([0, 1], [0, 0], 6),
         ([0, 1], [6, 6], 1), ([0, 1], [7, 7], 3), ([1, 2], [10, 0], 1), ([2, 3], [1, 14], 2)]


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_prepared_forward_equals_plain_forward_fp32(tiny_dir, storage):
    plain = load_llama(tiny_dir)
    prepared = load_llama(tiny_dir, plan=ForcedPlan(storage))
    assert prepared.layers[0].qkv.storage == storage and isinstance(prepared.lm_head, PackedLinear)
    for got, want in zip(_forwards(prepared, STEPS), _forwards(plain, STEPS)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prepared_forward_bf16_is_close(tiny_dir):
    plain = load_llama(tiny_dir)
    prepared = load_llama(tiny_dir, plan=ForcedPlan("plain", torch.bfloat16))
    assert prepared.dtype == torch.bfloat16 and prepared.new_cache(1, 4).k.dtype == torch.bfloat16
    for got, want in zip(_forwards(prepared, STEPS), _forwards(plain, STEPS)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=0.15, rtol=0)


def test_prepared_forward_bfloat16_weights_is_close(tiny_dir):
    """bfloat16 weights through the stream kernel (AMX / AVX512-BF16 / C), x rounded to bf16 at each
    matmul, everything else float32 (the served bfloat16); the tied head's embedding rows come out of
    the pairs layout."""
    plain = load_llama(tiny_dir)
    prepared = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, torch.bfloat16))
    assert prepared.dtype == torch.float32 and prepared.new_cache(1, 4).k.dtype == torch.float32
    assert prepared.layers[0].qkv.dtype == torch.bfloat16 and prepared.lm_head.dtype == torch.bfloat16
    torch.testing.assert_close(prepared.embed_tokens(torch.tensor([0, 5, 17])),
                               plain.embed_tokens(torch.tensor([0, 5, 17])).bfloat16().float())
    for got, want in zip(_forwards(prepared, STEPS), _forwards(plain, STEPS)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=0.15, rtol=0)


def test_prepared_forward_float16_weights_is_close(tiny_dir):
    """float16 weights through the stream kernel, everything else float32: the only error is the
    weights' rounding (2^-11 relative), far inside bf16's."""
    plain = load_llama(tiny_dir)
    prepared = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, torch.float16))
    assert prepared.dtype == torch.float32 and prepared.new_cache(1, 4).k.dtype == torch.float32
    assert prepared.layers[0].qkv.dtype == torch.float16 and prepared.lm_head.dtype == torch.float16
    for got, want in zip(_forwards(prepared, STEPS), _forwards(plain, STEPS)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=0.02, rtol=0)


@pytest.mark.parametrize("dtype, rounding, near", [(torch.int8, 0.1, 0.2), (torch.quint4x2, 0.25, 1.5)])
def test_prepared_forward_quantized_weights_is_close(tiny_dir, dtype, rounding, near):
    """int8 (a scale per group of 32) and 4-bit (Q4_1) weights through the stream kernel, everything else
    float32: the forward stays near the plain model's on the dequantized weights (the kernel multiplies x
    rounded to int8 per group of 32: measured up to 0.07 (int8) and 0.17 (q4) on logits of ~3.7; the kernel's
    arithmetic itself is held to quantize.matmul_reference in test_quantize), and near the float32 one
    (the weights' rounding too: the tiny model's random weights are not on a 4-bit grid, so q4 moves them
    by up to 1/30 of a group's range)."""
    from specrl.models.calibration import convert

    plain = load_llama(tiny_dir)
    prepared = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, dtype))
    head = torch.int8 if dtype == torch.quint4x2 else dtype  # q4 keeps the (tied) head in int8
    assert prepared.dtype == torch.float32 and prepared.layers[0].qkv.dtype == dtype and prepared.lm_head.dtype == head
    dequantized = load_llama(tiny_dir)
    with torch.no_grad():
        for name, param in dequantized.named_parameters():
            if param.dim() == 2:  # every linear and the tied embedding / head
                param.copy_(convert(param, head if name == "embed" else dtype).dequantize())
    torch.testing.assert_close(prepared.embed_tokens(torch.tensor([0, 5, 17])),
                               dequantized.embed_tokens(torch.tensor([0, 5, 17])))
    for got, want, close in zip(_forwards(prepared, STEPS), _forwards(dequantized, STEPS), _forwards(plain, STEPS)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=rounding, rtol=0)
        torch.testing.assert_close(got, close, atol=near, rtol=0)


def test_calibrated_model_equals_plain(tiny_dir, tmp_path):
    plan = Calibration.open(tmp_path, "float32")
    prepared = load_llama(tiny_dir, plan=plan)
    for got, want in zip(_forwards(prepared, STEPS), _forwards(load_llama(tiny_dir), STEPS)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (tmp_path / "linears-float32-1t.json").is_file()


def _held_bytes(model) -> int:
    """Bytes of every distinct tensor the model holds: parameters and packed weights."""
    seen, total = set(), 0
    for value in [*model.parameters(), *(v for m in model.modules() for v in vars(m).values())]:
        if isinstance(value, (torch.Tensor, PackedLinear)) and id(value) not in seen:
            seen.add(id(value))
            total += value.nbytes
    return total


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_prepared_model_holds_one_copy_of_each_weight(tiny_dir, storage):
    plain = load_llama(tiny_dir)
    prepared = load_llama(tiny_dir, plan=ForcedPlan(storage))
    assert not [n for n, p in prepared.named_parameters() if p.dim() == 2]  # every matrix is packed, none kept
    assert prepared.embed is prepared.lm_head  # tied: the head's one copy serves the lookup too
    assert _held_bytes(plain) <= _held_bytes(prepared) <= 1.05 * _held_bytes(plain)
    assert prepared.streamed_weight_bytes() >= plain.streamed_weight_bytes()


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_hf_state_of_a_prepared_model_is_plain(tiny_dir, storage):
    plain, prepared = load_llama(tiny_dir), load_llama(tiny_dir, plan=ForcedPlan(storage))
    want, got = plain.hf_state(), prepared.hf_state()
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].is_contiguous() and torch.equal(got[name], value), name


def test_prepared_model_refuses_loads_and_a_second_prepare(tiny_dir):
    prepared = load_llama(tiny_dir, plan=ForcedPlan("plain"))
    with pytest.raises(ValueError, match="build a fresh one"):
        prepared.load_hf_state(load_llama(tiny_dir).hf_state())
    with pytest.raises(ValueError, match="already prepared"):
        prepared.prepare_inference(ForcedPlan("plain"))


@pytest.mark.parametrize("draft_vocab_size", [0, 64])
def test_prepared_drafter_equals_plain_drafter(tiny_dir, draft_vocab_size):
    plain_target = load_llama(tiny_dir)
    drafter = EagleDrafter.day0(plain_target, seed=2, draft_vocab_size=draft_vocab_size)
    target = load_llama(tiny_dir, plan=ForcedPlan("onednn"))
    from_prepared = EagleDrafter.day0(target, seed=2, draft_vocab_size=draft_vocab_size)  # the engine's order
    for name, value in drafter.state_dict().items():
        assert torch.equal(from_prepared.state_dict()[name], value), name
    prepared = from_prepared.prepare_inference(ForcedPlan("transposed"))
    feats, toks = torch.randn(2, 5, plain_target.cfg.hidden_size), torch.randint(0, 500, (2, 5))
    with torch.inference_mode():
        want = drafter.logits(drafter(feats, toks, torch.tensor([0, 2]), torch.tensor([0, 3]), drafter.new_cache(3, 16)))
        got = prepared.logits(prepared(feats, toks, torch.tensor([0, 2]), torch.tensor([0, 3]), prepared.new_cache(3, 16)))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("storage, dtype, weight_dtype", [("blocked", torch.float32, torch.float32),
                                                        ("blocked", torch.float32, torch.int8),
                                                        ("blocked", torch.float32, torch.quint4x2),
                                                        ("plain", torch.bfloat16, None)])  # torch's attention path
def test_a_drafting_loops_passes_over_one_advanced_batch_equal_forwards(tiny_dir, storage, dtype, weight_dtype):
    """`EagleDrafter.step` over a batch built once and advanced a pass (`CacheBatch.advance`) computes the
    bits `forward` computes over a batch built at each position, rows at different positions, and writes the
    same keys and values: through the C kernels (float32 caches) and through torch's ops (bfloat16)."""
    from specrl.models.kv_cache import CacheBatch

    if cpu_kernels is None and storage == "blocked":
        pytest.skip("the stream kernel is not built")
    plan = ForcedPlan(storage, dtype, weight_dtype)
    drafter = EagleDrafter.day0(load_llama(tiny_dir, plan=plan), seed=1, draft_vocab_size=64).prepare_inference(plan)
    slots, start = torch.tensor([2, 0]), torch.tensor([5, 9])
    hidden, caches = torch.randn(2, drafter.cfg.hidden_size), [drafter.new_cache(3, 16), drafter.new_cache(3, 16)]
    stepped, forwarded = hidden, hidden
    with torch.inference_mode():
        batch = CacheBatch(caches[0], slots, start, 1)
        assert batch.fused == (dtype == torch.float32)
        for i, token in enumerate(torch.tensor([[7, 3], [11, 60], [0, 42]])):
            if i:
                batch.advance()
            stepped = drafter.step(stepped, token, batch)
            forwarded = drafter(forwarded[:, None], token[:, None], slots, start + i, caches[1])[:, 0]
            assert torch.equal(stepped, forwarded)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert batch.positions[:, 0].tolist() == [7, 11]
    with pytest.raises(ValueError, match="one token a row"):
        CacheBatch(caches[0], slots, start, 2).advance()
    with pytest.raises(ValueError, match="does not fit"):
        edge = CacheBatch(caches[0], slots, torch.tensor([14, 15]), 1)
        edge.advance()


def test_drafter_refuses_a_plan_of_another_dtype(tiny_dir):
    from specrl.errors import IncompatibleDrafterError

    target = load_llama(tiny_dir, plan=ForcedPlan("plain"))
    with pytest.raises(IncompatibleDrafterError, match="its target runs in"):
        EagleDrafter.day0(target).prepare_inference(ForcedPlan("plain", torch.bfloat16))


# ---- SmolLM2 against transformers, per dtype ----------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Explain photosynthesis in simple terms.",
           "1, 2, 3, 5, 8, 13,"]


def _hf_parity(model_dir, plan):
    """-> (max |logit diff|, argmax agreements, positions) of the prepared model (prefill, a
    2-token verify, a decode step) against HF's fp32 forward over each whole prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = load_llama(model_dir, plan=plan)
    worst, agree, total = 0.0, 0, 0
    cache = model.new_cache(4, 64)
    with torch.inference_mode():
        for i, prompt in enumerate(PROMPTS):
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            n, slot = ids.shape[1], torch.tensor([3 - i])
            pieces = [model.logits(model(ids[:, a:b], slot, torch.tensor([a]), cache))
                      for a, b in ((0, n - 3), (n - 3, n - 1), (n - 1, n))]
            got, want = torch.cat(pieces, 1)[0], ref(ids).logits[0]
            worst = max(worst, float((got - want).abs().max()))
            agree, total = agree + int((got.argmax(-1) == want.argmax(-1)).sum()), total + n
    return worst, agree, total


@pytest.fixture(scope="module")
def calibration_dir(tmp_path_factory):
    """One calibration directory for the SmolLM2 tests: bf16's float32 reference reuses fp32's."""
    return tmp_path_factory.mktemp("calibration")


@pytest.mark.slow
def test_smollm2_fp32_matches_transformers(smollm_dir, calibration_dir):
    worst, agree, total = _hf_parity(smollm_dir, Calibration.open(calibration_dir, "float32"))
    assert worst < 1e-3 and agree == total


@pytest.mark.slow
def test_smollm2_bf16_argmax_mostly_agrees_with_transformers(smollm_dir, calibration_dir):
    """bfloat16 weights, float32 activations, x rounded to bf16 at the matmuls (AMX / AVX512-BF16 /
    oneDNN; emulated without avx512_bf16/amx_bf16: slower, with a warning). Measured on the AMX Xeon:
    0.37, 36 of 36 (1.87 and 35 of 36 when activations and KV cache were bf16 too)."""
    plan = Calibration.open(calibration_dir, "bfloat16")
    worst, agree, total = _hf_parity(smollm_dir, plan)
    assert agree >= total - 1 and worst < 1.0, (worst, agree, total)
    assert ("WARNING" in plan.packed_note()) == (plan.slowdown() is not None)


@pytest.mark.slow
def test_smollm2_float16_weights_agree_with_transformers(smollm_dir, calibration_dir):
    """float16 weights, float32 compute (the stream kernel): only the weights' rounding differs."""
    plan = Calibration.open(calibration_dir, "float16")
    worst, agree, total = _hf_parity(smollm_dir, plan)
    assert agree >= total - 1 and worst < 0.2, (worst, agree, total)  # measured: 0.035, 36 of 36


@pytest.mark.slow
def test_smollm2_int8_weights_agree_with_transformers(smollm_dir, calibration_dir):
    """int8 weights (a scale per output and group of 32) times x rounded to int8 per group of 32: the greedy
    picks of 36 positions against HF's float32 (the quality over many answers: `specrl bench quality`)."""
    plan = Calibration.open(calibration_dir, "int8")
    worst, agree, total = _hf_parity(smollm_dir, plan)
    assert agree >= total - 2 and worst < 2.0, (worst, agree, total)


@pytest.mark.slow
def test_smollm2_q4_serves_the_ggufs_own_weights(smollm_dir, calibration_dir):
    """q4: the layers' Q4_1 values and the head's Q8_0 values of SmolLM2's GGUF come back exactly when packed
    (quantize.py; test_quantize checks the round trip), so against HF's float32 (the same values dequantized)
    only the kernel's arithmetic differs: x rounded to int8 per group of 32, as llama.cpp rounds it for these
    formats (measured on an AVX-512 EPYC: 35 of 36 greedy picks, largest logit difference 1.05)."""
    plan = Calibration.open(calibration_dir, "q4")
    worst, agree, total = _hf_parity(smollm_dir, plan)
    assert agree >= total - 2 and worst < 2.0, (worst, agree, total)


def _mapped_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if line.count("/") and line.split()[-1].startswith("/")}


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_loading_reads_the_checkpoint_without_mapping_it(tiny_dir):
    """Weights are read into the parameters with file reads: a memory map of the checkpoint would
    count in RSS until closed (SmolLM2 through safe_open peaked at model + the whole 538 MB file)."""
    before = _mapped_files()
    from specrl.models.llama import TensorSource

    source = TensorSource.from_dir(tiny_dir)
    model = load_llama(tiny_dir, plan=ForcedPlan("plain", torch.bfloat16))  # bf16: through one fp32 temporary
    new = {path for path in _mapped_files() - before if path.endswith(".safetensors")}
    assert not new
    assert model.dtype == torch.bfloat16 and source.get("model.norm.weight").dtype == torch.float32


def test_plain_model_still_backpropagates(tiny_dir):
    """The trainers' form: plain parameters, causal forward without a cache, gradients everywhere."""
    model = load_llama(tiny_dir)
    model.requires_grad_(True)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    loss = torch.nn.functional.cross_entropy(model.logits(model(tokens))[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None or not g.abs().sum() > 0]


def test_positions_past_the_cache_are_refused(tiny_dir):
    model = load_llama(tiny_dir)
    cache = model.new_cache(num_slots=3, max_len=8)
    with torch.inference_mode(), pytest.raises(ValueError, match="do not fit a KV cache of 8 positions"):
        model(torch.zeros(2, 2, dtype=torch.long), torch.tensor([2, 0]), torch.tensor([3, 7]), cache)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.int8, torch.quint4x2])
def test_the_streamed_layers_in_one_loop_equal_one_module_call_each(tiny_dir, weight_dtype):
    """A decode or verify step whose layers all stream runs them in one loop with shared buffers
    (`Llama._forward_streamed`): the same bits as each layer's own module call, and the same cache writes."""
    from specrl.models.kv_cache import CacheBatch

    if cpu_kernels is None:
        pytest.skip("the stream kernel is not built")
    model = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, weight_dtype))
    tokens, slots, start = torch.tensor([[3, 17, 5], [9, 2, 40]]), torch.tensor([0, 1]), torch.tensor([4, 7])
    caches = [model.new_cache(2, 16), model.new_cache(2, 16)]
    with torch.inference_mode():
        looped = model(tokens, slots, start, caches[0])
        batch = CacheBatch(caches[1], slots, start, tokens.shape[1])
        assert batch.fused and all(layer.streams(model.embed_tokens(tokens)) for layer in model.layers)
        cos, sin = model.rope.tables(batch.positions)
        x = model.embed_tokens(tokens)
        for i, layer in enumerate(model.layers):
            x = layer(x, cos, sin, batch, i)
    assert torch.equal(looped, x.float())
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.int8, torch.quint4x2])
def test_a_prompt_computes_the_same_bits_alone_beside_a_longer_one_or_token_by_token(tiny_dir, weight_dtype):
    """A position's hidden state and cached keys depend on its own tokens only, not on what else its forward
    holds: a 40-token prompt prefilled alone, in one forward beside a 57-token one (padded), or as 39 tokens then
    one. A prefix-cache hit reuses keys computed in whatever batch came first, so greedy speculation is exact
    over a prefix cache only if this holds (torch's attention for chunks longer than a verify broke it: outputs
    of `bench adapt` on q4 differed from plain decoding after its batch-4 runs filled the cache)."""
    if cpu_kernels is None:
        pytest.skip("the stream kernel is not built")
    model = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, weight_dtype))
    gen = torch.Generator().manual_seed(1)
    prompt, other = (torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in (40, 57))
    with torch.inference_mode():
        alone = model.new_cache(1, 64)
        want = model(prompt[None], torch.tensor([0]), torch.tensor([0]), alone)[0]
        beside = model.new_cache(2, 64)
        padded = torch.zeros(2, 57, dtype=torch.long)
        padded[0], padded[1, :40] = other, prompt
        got = model(padded, torch.tensor([0, 1]), torch.tensor([0, 0]), beside, torch.tensor([57, 40]))[1, :40]
        stepped = model.new_cache(1, 64)
        model(prompt[None, :39], torch.tensor([0]), torch.tensor([0]), stepped)
        last = model(prompt[None, 39:], torch.tensor([0]), torch.tensor([39]), stepped)[0, 0]
    assert torch.equal(got, want) and torch.equal(last, want[-1])
    with torch.inference_mode():  # longer than one fused call: cut into pieces, still the same bits as token by token
        long = torch.randint(0, model.cfg.vocab_size, (150,), generator=gen)
        whole = model(long[None], torch.tensor([0]), torch.tensor([0]), model.new_cache(1, 160))[0]
        split = model.new_cache(1, 160)
        model(long[None, :100], torch.tensor([0]), torch.tensor([0]), split)
        tail = model(long[None, 100:], torch.tensor([0]), torch.tensor([100]), split)[0]
    assert torch.equal(tail, whole[100:])
    for cache, slot in ((beside, 1), (stepped, 0)):
        assert torch.equal(cache.k[:, slot, :, :40], alone.k[:, 0, :, :40])
        assert torch.equal(cache.v[:, slot, :, :40], alone.v[:, 0, :, :40])


class CallPlan(ForcedPlan):
    """Every layer linear on one stream call of int8 and 4-bit weights (`call`, a subclass's)."""

    call: str

    def choose(self, shape, *, head=False, tied=False):
        choice = super().choose(shape, head=head, tied=tied)
        if choice.storage != "blocked":
            return choice
        return Choice("blocked", choice.buckets, (self.call,) * len(choice.buckets), choice.slowdown,
                      choice.expected_ms)


class PrefetchPlan(CallPlan):
    call = "stream prefetch"


class AmxPlan(CallPlan):
    call = "stream amx"


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.quint4x2])
@pytest.mark.parametrize("plan_class", [PrefetchPlan, AmxPlan])
def test_every_stream_call_computes_the_same_bits_in_the_layer_loop(tiny_dir, weight_dtype, plan_class):
    """"stream prefetch" only reads ahead, and "stream amx" sums each group on AMX-INT8 tiles: a forward through
    either, in the C layer loop, equals the plain stream call's to the bit, and the layer loop passes each
    linear's (gemm path, prefetch distance)."""
    from specrl.models.linear import AMX_INT8, CALLS, PATH_AMX_INT8, PREFETCH_BYTES

    if cpu_kernels is None:
        pytest.skip("the stream kernel is not built")
    if not CALLS[plan_class.call].dtypes:
        assert plan_class is AmxPlan and not AMX_INT8  # offered only where the CPU has AMX-INT8
        pytest.skip("this CPU has no AMX-INT8 tiles")
    plain = load_llama(tiny_dir, plan=ForcedPlan("blocked", torch.float32, weight_dtype))
    other = load_llama(tiny_dir, plan=plan_class("blocked", torch.float32, weight_dtype))
    layer = other.layers[0]
    want_args = (0 if plan_class is PrefetchPlan else PATH_AMX_INT8, PREFETCH_BYTES)
    assert all(getattr(layer, n).streams(3) and getattr(layer, n).stream_args(3) == want_args for n in layer.LINEARS)
    assert plain.layers[0].qkv.stream_args(3) == (0, 0)
    tokens, slots, start = torch.tensor([[3, 17, 5], [9, 2, 40]]), torch.tensor([0, 1]), torch.tensor([4, 7])
    with torch.inference_mode():
        want = plain(tokens, slots, start, plain.new_cache(2, 16))
        got = other(tokens, slots, start, other.new_cache(2, 16))
    assert torch.equal(want, got)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.int8, torch.quint4x2])
def test_all_layers_in_one_call_equal_one_call_a_layer(tiny_dir, weight_dtype):
    """`_cpu_kernels.layers` runs every layer of a step in one C call (Llama._forward_streamed): the same bits and
    the same cache writes as a `layer` call per layer, at one row and at a verify's several, with and without
    prefetching linears."""
    from specrl.models.kv_cache import CacheBatch

    if cpu_kernels is None:
        pytest.skip("the stream kernel is not built")
    plan = (PrefetchPlan if weight_dtype != torch.float32 else ForcedPlan)("blocked", torch.float32, weight_dtype)
    model = load_llama(tiny_dir, plan=plan)
    for tokens, slots, start in ((torch.tensor([[7]]), torch.tensor([1]), torch.tensor([5])),
                                 (torch.tensor([[3, 17, 5], [9, 2, 40]]), torch.tensor([0, 1]), torch.tensor([4, 7]))):
        caches = [model.new_cache(2, 16), model.new_cache(2, 16)]
        with torch.inference_mode():
            one_call = model(tokens, slots, start, caches[0])
            batch = CacheBatch(caches[1], slots, start, tokens.shape[1])
            cos, sin = model.rope.tables(batch.positions)
            x = model.embed_tokens(tokens)
            for i, layer in enumerate(model.layers):
                x = layer.forward_streamed(x, cos.contiguous(), sin.contiguous(), batch, i)
        assert torch.equal(one_call, x.float())
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
