"""A GGUF's blocks as they ship: Q4_1 -> Q4Weight, Q8_0 -> Int8Weight, F32 -> tensors, q/k rows put back in HF's
order; checked against the gguf package's own quantizer and dequantizer (written and read through real files),
and, on SmolLM2, `--dtype q4` from its GGUF against the float32 checkpoint's round trip: the same packed bytes."""

import os

import numpy as np
import pytest
import torch

from specrl.errors import InvalidRequestError
from specrl.models.gguf_reader import read_gguf
from specrl.models.quantize import Int8Weight, Q4Weight

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (per head, the rotary halves interleaved)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _write(path, tensors: dict[str, tuple[np.ndarray, "Q"]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        if kind == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_blocks_come_back_as_the_gguf_package_dequantizes_them(tmp_path):
    rng = np.random.default_rng(0)
    q_proj = rng.standard_normal((64, 96), dtype=np.float32)  # 4 heads of 16
    down = rng.standard_normal((32, 64), dtype=np.float32)
    embed = rng.standard_normal((40, 96), dtype=np.float32)
    norm = rng.standard_normal(96, dtype=np.float32)
    path = tmp_path / "m.gguf"
    _write(path, {"blk.0.attn_q.weight": (_permute(q_proj, 4), Q.Q4_1), "blk.0.ffn_down.weight": (down, Q.Q4_1),
                  "token_embd.weight": (embed, Q.Q8_0), "blk.0.attn_norm.weight": (norm, Q.F32),
                  "not_ours.weight": (norm, Q.F32)})
    got = read_gguf(path, num_layers=1, num_heads=4, num_kv_heads=2)
    assert sorted(got) == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                           "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    oracle = {name: gguf.quants.dequantize(gguf.quants.quantize(v, kind), kind)
              for name, v, kind in [("q", q_proj, Q.Q4_1), ("down", down, Q.Q4_1), ("embed", embed, Q.Q8_0)]}
    assert isinstance(got["model.layers.0.mlp.down_proj.weight"], Q4Weight)
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"].dequantize(), torch.from_numpy(oracle["down"]))
    # q's rows: quantized in llama.cpp's order, back in HF's (each row's blocks with it)
    stored = gguf.quants.dequantize(gguf.quants.quantize(_permute(q_proj, 4), Q.Q4_1), Q.Q4_1)
    want_q = np.empty_like(stored)
    want_q[_permute(np.arange(64), 4)] = stored  # stored row i is HF row order[i]
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"].dequantize(), torch.from_numpy(want_q))
    assert torch.allclose(got["model.layers.0.self_attn.q_proj.weight"].dequantize(), torch.from_numpy(q_proj), atol=0.3)
    embed_got = got["model.embed_tokens.weight"]
    assert isinstance(embed_got, Int8Weight) and torch.equal(embed_got.dequantize(), torch.from_numpy(oracle["embed"]))
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], torch.from_numpy(norm))
    # the round trip the float32 checkpoint takes gives these very blocks back
    back = Q4Weight.from_float(got["model.layers.0.mlp.down_proj.weight"].dequantize())
    assert torch.equal(back.q, got["model.layers.0.mlp.down_proj.weight"].q)


def test_a_tensor_type_it_does_not_read_is_one_line_naming_it(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, {"blk.0.ffn_up.weight": (np.ones((32, 64), dtype=np.float32), Q.Q5_0)})
    with pytest.raises(InvalidRequestError) as err:
        read_gguf(path, 1, 4, 2)
    assert "blk.0.ffn_up.weight is Q5_0" in err.value.message and "F32, Q4_1, Q8_0" in err.value.message
    assert "\n" not in err.value.message


def test_only_a_fetched_directory_whose_manifest_names_its_gguf_is_served_from_it(tmp_path):
    """A copy of a model directory with changed safetensors (a perturbed policy) may carry the GGUF file along
    but not the asset manifest: it is read from its safetensors."""
    import json

    from specrl.models.gguf_reader import shipped_gguf

    fetched = tmp_path / "fetched"
    fetched.mkdir()
    (fetched / "manifest.json").write_text(json.dumps({"source": {"member": "pkg/Model.Q4_1.gguf"}}))
    assert shipped_gguf(fetched) is None  # named, not there
    (fetched / "Model.Q4_1.gguf").write_bytes(b"GGUF")
    assert shipped_gguf(fetched) == fetched / "Model.Q4_1.gguf"
    copied = tmp_path / "copied"
    copied.mkdir()
    (copied / "Model.Q4_1.gguf").write_bytes(b"GGUF")
    assert shipped_gguf(copied) is None
    (copied / "manifest.json").write_text(json.dumps({"version": "v3", "parent": "v2"}))  # a store's manifest
    assert shipped_gguf(copied) is None


@pytest.mark.slow
def test_smollm2_q4_from_its_gguf_packs_the_same_bytes_as_the_round_trip(smollm_dir, home, tmp_path):
    """SmolLM2 with its GGUF beside (as assets keep it) loads through the GGUF's blocks; without, through the
    float32 checkpoint re-quantized: every packed weight the same bytes, the norms the same values."""
    from specrl.assets import gguf_file
    from specrl.models.calibration import Calibration
    from specrl.models.llama import load_llama

    with_gguf, without = tmp_path / "with", tmp_path / "without"
    for directory in (with_gguf, without):
        directory.mkdir()
        for f in smollm_dir.iterdir():
            if f.suffix != ".gguf":
                os.symlink(f, directory / f.name)
    shipped = gguf_file(home, progress=False)
    os.symlink(shipped, with_gguf / shipped.name)  # where fetch-model keeps it, as the manifest names it
    plan = Calibration.open(tmp_path / "calibration", "q4")
    direct, round_trip = load_llama(with_gguf, plan=plan), load_llama(without, plan=plan)
    for a, b in zip(direct.streamed_weights(), round_trip.streamed_weights()):
        assert a.dtype == b.dtype and torch.equal(a.stored, b.stored)
    assert all(torch.equal(la.input_norm, lb.input_norm) and torch.equal(la.post_norm, lb.post_norm)
               for la, lb in zip(direct.layers, round_trip.layers))
    assert torch.equal(direct.norm, round_trip.norm)
