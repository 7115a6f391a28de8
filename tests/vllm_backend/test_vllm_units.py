"""vLLM-backend units that need vllm imported, checked in one child process (importing vllm into the
test process changes torch's threading for every later test): the CPU expand fix gives the exact
expansion at the caller's dtype, and the engine arguments ask for per-request spec-decode
metrics only with a drafter (vLLM refuses them without speculation)."""

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
    settings = Settings()
    for eagle in (None, Path("/tmp/eagle")):
        args = engine_args(settings, Path("/m"), Path("/m"), eagle)
        out[str(eagle)] = [args.per_request_spec_decode_metrics, args.speculative_config]
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
