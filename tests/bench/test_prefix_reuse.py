"""`specrl bench serve`'s prefix-reuse report logic (specrl/apps/bench/prefix_reuse.py), without
servers: ratios against the issue's targets, what counts as a choice's first token."""

from specrl.apps.bench.prefix_reuse import _has_token, reuse_ratios


def row(backend, scenario, on, p50):
    field = "ttft_ms" if scenario == "shared_prefix" else "eighth_first_token_ms"
    return {"backend": backend, "scenario": scenario, "prefix_cache": on, field: {"p50": p50}}


def test_ratios_are_reuse_over_none_with_the_targets():
    rows = [row("native", "shared_prefix", True, 20.0), row("native", "shared_prefix", False, 100.0),
            row("native", "n8", True, 50.0), row("native", "n8", False, 100.0),
            row("vllm", "shared_prefix", True, 10.0)]
    ratios = reuse_ratios(rows)
    assert ratios["native"]["ttft_ms_p50_shared_prefix_reuse_over_none"] == {"ratio": 0.2, "target": 0.25, "met": True}
    assert ratios["native"]["eighth_first_token_ms_p50_n8_reuse_over_none"] == {"ratio": 0.5, "target": 0.3,
                                                                              "met": False}
    assert ratios["vllm"]["ttft_ms_p50_shared_prefix_reuse_over_none"]["ratio"] is None  # no run without reuse


def test_a_first_token_is_text_or_log_probs_never_the_role_chunk():
    assert not _has_token({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None})
    assert _has_token({"index": 0, "delta": {"content": ""}, "logprobs": {"content": [{"token": "<s>"}]}})
    assert _has_token({"index": 1, "text": "Hi", "logprobs": None})
    assert _has_token({"index": 1, "text": "", "logprobs": {"tokens": ["\ufffd"]}})
    assert not _has_token({"index": 1, "text": "", "logprobs": None})
