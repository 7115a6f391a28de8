"""Export a specrl drafter to the EAGLE-1 head format vLLM's `speculative_config` loads.

The exported directory holds `config.json` (the target's config with one layer) and
`model.safetensors` with vLLM's EAGLE-1 names, no `model.` prefix:

    fc.weight [H, 2H]                 feature columns divided by the drafter's feature_scale
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight
    embed_tokens.weight [V, H]        the target's (vLLM shares it when identical)

(vLLM's EAGLE-1 Llama head has no lm_head of its own: it always uses the target's.)

Parts of a specrl drafter have no place in that layout; `specrl/extra.safetensors` keeps
them for specrl's own vLLM backend, whose worker extension restores them after load:

- `layers.0.input_layernorm.weight`: the drafter layer's input norm (vLLM's EAGLE-1 layer 0
  has none);
- a reduced draft vocabulary: `head.weight` [V_d, H] and `draft_to_target` [V_d] int64 (the
  worker scatters the head's logits into the full vocabulary, -inf elsewhere);
- the target's final norm before the head: vLLM's EAGLE-1 head takes logits straight from the
  layer output (specrl's worker computes the drafter's logits with the target's norm + head).

specrl's drafter also reads the target's hidden state before its final norm, where vLLM
hands EAGLE-1 the normed one; specrl's backend gives it the pre-norm state (the worker moves
the target's final norm into its logits computation). Plain vLLM therefore runs an
approximation of the drafter (and the target's full head in place of a reduced one): outputs stay exact (speculation is lossless), only the
acceptance rate is lower.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specrl.errors import IncompatibleDrafterError

EXTRA_FILE = "specrl/extra.safetensors"  # in a sub-folder: vLLM loads every top-level *.safetensors
INPUT_NORM = "layers.0.input_layernorm.weight"
DRAFT_HEAD, DRAFT_TO_TARGET = "head.weight", "draft_to_target"
_LAYER = {"o": ["self_attn.o_proj.weight"], "post_norm": ["post_attention_layernorm.weight"],
          "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "down": ["mlp.down_proj.weight"]}


def eagle_layer_tensors(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A specrl drafter's state dict (`EagleDrafter.state_dict()`) -> vLLM EAGLE-1 tensors of the
    fc and the layer (no embeddings, no head), the input norm under `INPUT_NORM`.
    `cfg` is the drafter's `DrafterConfig`."""
    h = cfg.hidden_size
    fc = state["fc"].float().clone()
    fc[:, h:] /= state["feature_scale"].float()[None, :]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"fc.weight": fc, INPUT_NORM: state["layer.input_norm"]}
    for (name, part) in zip("qkv", state["layer.qkv"].split([q, kv, kv])):
        out[f"layers.0.self_attn.{name}_proj.weight"] = part
    for param, names in _LAYER.items():
        for name, part in zip(names, state[f"layer.{param}"].chunk(len(names))):
            out[f"layers.0.{name}"] = part
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def draft_head_tensors(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A reduced draft vocabulary's head and token map ({} when the drafter uses the target's head)."""
    if cfg.draft_vocab_size == cfg.vocab_size:
        return {}
    return {DRAFT_HEAD: state["head"].detach().float().contiguous(),
            DRAFT_TO_TARGET: state["draft_to_target"].detach().long().contiguous()}


def export_vllm(drafter_dir: Path, target_dir: Path, out_dir: Path) -> Path:
    """Write the EAGLE-1 head directory for the drafter in `drafter_dir` (specrl format) serving
    the target in `target_dir` (HF safetensors). -> out_dir."""
    from safetensors.torch import save_file

    from specrl.models.drafter import CONFIG_FILE, WEIGHTS_FILE, DrafterConfig, read_state
    from specrl.models.llama import TensorSource

    drafter_dir, target_dir, out_dir = Path(drafter_dir), Path(target_dir), Path(out_dir)
    for f in (drafter_dir / CONFIG_FILE, drafter_dir / WEIGHTS_FILE, target_dir / "config.json"):
        if not f.is_file():
            raise IncompatibleDrafterError(f"{f} is missing: need a specrl drafter directory and an HF target directory")
    cfg = DrafterConfig(**json.loads((drafter_dir / CONFIG_FILE).read_text()))
    hf_config = json.loads((target_dir / "config.json").read_text())
    if cfg.hidden_size != hf_config["hidden_size"] or cfg.vocab_size != hf_config["vocab_size"]:
        raise IncompatibleDrafterError(f"the drafter (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not fit "
                                       f"the target in {target_dir}")
    state = read_state(drafter_dir)
    tensors = eagle_layer_tensors(state, cfg)
    extra = {INPUT_NORM: tensors.pop(INPUT_NORM), **draft_head_tensors(state, cfg)}
    source = TensorSource.from_dir(target_dir)
    tensors["embed_tokens.weight"] = source.get("model.embed_tokens.weight").float().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / EXTRA_FILE).parent.mkdir(exist_ok=True)
    save_file(extra, str(out_dir / EXTRA_FILE))
    config = {**hf_config, "num_hidden_layers": 1}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json",):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir
