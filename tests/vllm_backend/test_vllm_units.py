"""vLLM-backend units that need vllm imported, checked in one child process (importing vllm into the
test process changes torch's threading for every later test): the CPU expand fix gives the exact
expansion at the caller's dtype, the engine arguments ask for per-request spec-decode metrics
only with a drafter (vLLM refuses them without speculation), prefix caching follows the
setting, and every sampling parameter maps onto vLLM's SamplingParams."""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the [vllm] extra is not installed")]

CHILD = textwrap.dedent("""
    import json
    from pathlib import Path

    import torch
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does at start
    import vllm.v1.sample.rejection_sampler as rs

    from specrl.config import Settings
    from specrl.serving.vllm.build import engine_args
    from specrl.serving.vllm.cpu_fixes import expand_batch_to_tokens, install_cpu_expand_fix

    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = {"before": rs.expand_batch_to_tokens is expand_batch_to_tokens, "status": install_cpu_expand_fix()}
    out["patched"] = rs.expand_batch_to_tokens is expand_batch_to_tokens
    out["again"] = install_cpu_expand_fix()
    cases = {"float32": torch.tensor([0.8, 0.5, -1.0]), "int32": torch.tensor([5, 7, 9], dtype=torch.int32),
             "int64": torch.tensor([5, 7, -1]), "float64": torch.tensor([0.25, 0.5, 2.0], dtype=torch.float64)}
    for name, x in cases.items():
        y = rs.expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=1)
        out[name] = {"dtype": str(y.dtype), "values": y.tolist()}
    out["empty"] = rs.expand_batch_to_tokens(torch.tensor([0.8]), torch.tensor([0], dtype=torch.int32), 0).tolist()
    from specrl.serving.vllm.cpu_fixes import install_empty_draft_fix

    original = rs.apply_top_k_top_p
    out["guard"] = [install_empty_draft_fix(), install_empty_draft_fix()]
    empty = torch.zeros(0, 9)
    out["guard_empty"] = list(rs.apply_top_k_top_p(empty, torch.zeros(0, dtype=torch.long), None).shape)
    row = torch.tensor([[0.1, 3.0, 2.0, -1.0]])
    out["guard_rows"] = torch.equal(rs.apply_top_k_top_p(row.clone(), torch.tensor([2]), None),
                                    original(row.clone(), torch.tensor([2]), None))
    settings = Settings()
    for eagle in (None, Path("/tmp/eagle")):
        args = engine_args(settings, Path("/m"), Path("/m"), eagle)
        out[str(eagle)] = [args.per_request_spec_decode_metrics, args.speculative_config]
    out["prefix_caching"] = [engine_args(Settings(prefix_cache=on), Path("/m"), Path("/m"), None).enable_prefix_caching
                             for on in (True, False)]
    from specrl.serving.vllm.loop import _vllm_params
    from specrl.speculation.sampling import SamplingParams
    ours = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, min_tokens=3, seed=4,
                          stop=("x",), stop_token_ids=(7,), ignore_eos=True, logprobs=2, repetition_penalty=1.2,
                          presence_penalty=0.5, frequency_penalty=-0.5, logit_bias=((11, 2.5),),
                          include_stop_str_in_output=True, skip_special_tokens=False,
                          spaces_between_special_tokens=False)
    theirs = _vllm_params(ours)
    out["params"] = {name: getattr(theirs, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                     "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens")}
    out["params"]["logit_bias"] = {str(k): v for k, v in theirs.logit_bias.items()}
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def child():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_the_cpu_expand_fix_is_installed_once_on_the_broken_cpu_path(child):
    assert not child["before"] and child["patched"]
    assert child["status"].startswith("installed") and child["again"].startswith("installed")


@pytest.mark.parametrize("dtype,want", [
    ("float32", [0.800000011920929] * 2 + [0.5] * 3 + [1.0]),  # temperature: -1 (greedy) -> 1
    ("int32", [5, 5, 7, 7, 7, 9]),  # top_k
    ("int64", [5, 5, 7, 7, 7, 1]),
    ("float64", [0.25, 0.25, 0.5, 0.5, 0.5, 2.0]),
])
def test_the_fixed_expansion_is_exact_at_the_callers_dtype(child, dtype, want):
    assert child[dtype] == {"dtype": f"torch.{dtype}", "values": want}
    assert child["empty"] == []


def test_spec_decode_metrics_are_asked_for_only_with_a_drafter(child):
    assert child["None"] == ["none", None]
    metrics, spec = child["/tmp/eagle"]
    assert metrics == "summary" and spec["method"] == "eagle" and spec["model"] == "/tmp/eagle"


def test_top_k_on_a_step_without_drafts_does_not_kill_the_engine(child):
    """vLLM 0.32 takes k.max() of an empty tensor when no request drafts in a step and one has top_k."""
    assert child["guard"][0].startswith("installed") and child["guard"][1].startswith("already")
    assert child["guard_empty"] == [0, 9] and child["guard_rows"]


def test_vllms_prefix_caching_follows_the_prefix_cache_setting(child):
    assert child["prefix_caching"] == [True, False]


def test_every_sampling_parameter_reaches_vllm(child):
    assert child["params"] == {
        "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "min_tokens": 3, "seed": 4,
        "stop": ["x"], "stop_token_ids": [7], "ignore_eos": True, "logprobs": 2, "repetition_penalty": 1.2,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "include_stop_str_in_output": True,
        "skip_special_tokens": False, "spaces_between_special_tokens": False, "logit_bias": {"11": 2.5}}


def test_reduced_draft_head_logits_land_at_their_target_ids():
    """The worker's drafter logits (pure torch, no vllm import): a reduced head's logits sit at
    their target ids, every other id is -inf, and without a reduced head the target's head is used."""
    import torch

    from specrl.serving.vllm.worker import _DraftLogits

    hidden, target_head = torch.randn(3, 8), torch.randn(20, 8)

    def norm(x):
        return x * 2

    logits = _DraftLogits(norm, lambda normed: normed @ target_head.T, vocab_size=20)
    torch.testing.assert_close(logits(hidden), (hidden * 2) @ target_head.T)
    head, ids = torch.randn(4, 8), torch.tensor([1, 7, 2, 19])
    logits.set_head(head, ids)
    out = logits(hidden)
    torch.testing.assert_close(out[:, ids], (hidden * 2) @ head.T)
    others = torch.ones(20, dtype=torch.bool)
    others[ids] = False
    assert torch.isinf(out[:, others]).all() and (out[:, others] < 0).all()
    assert out.argmax(-1).tolist() == ids[((hidden * 2) @ head.T).argmax(-1)].tolist()
