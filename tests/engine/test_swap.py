"""Hot swaps at step boundaries: drafter (immediate), policy drain and policy interrupt."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specrl.models.drafter import EagleDrafter
from specrl.errors import SwapError, SwapInProgressError
from specrl.engine.swap import load_swap
from specrl.speculation.sampling import SamplingParams
from tests.engine.conftest import chat_prompts

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def policy_v2(tiny_dir, tmp_path_factory):
    """The tiny model with perturbed weights: a different policy of the same architecture."""
    out = tmp_path_factory.mktemp("policy-v2")
    for f in tiny_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
              str(out / "model.safetensors"))
    return out


def _run(engine, seqs_wanted=None):
    while engine.has_work():
        engine.step()


def test_drafter_swap_changes_speed_not_output(make_engine, tokenizer, tmp_path):
    prompts = chat_prompts(tokenizer, 3)
    engine = make_engine(fixed_draft_tokens=2)
    reference = make_engine(drafter="none").generate(prompts, GREEDY)
    EagleDrafter.day0(engine.target, seed=99).save(tmp_path)
    seqs = [engine.submit(p, GREEDY) for p in prompts]
    for _ in range(3):
        engine.step()
    swap = load_swap("drafter", "d2", "drain", tmp_path, engine.target)
    engine.request_swap(swap)
    engine.step()
    assert swap.done.result(timeout=0).version == "d2" and engine.drafter_version == "d2"
    _run(engine)
    assert [s.output_ids for s in seqs] == [c.output_ids for c in reference]
    versions = {r.drafter_version for r in engine.sink.records}
    assert versions == {"day0", "d2"}
    assert all(run[2] in ("day0", "d2") for s in seqs for run in s.version_runs)
    assert seqs[0].version_runs[-1][2] == "d2"


def test_policy_drain_finishes_old_requests_on_old_weights(make_engine, tokenizer, policy_v2):
    prompts = chat_prompts(tokenizer, 4)
    old_ref = make_engine(drafter="none").generate(prompts, GREEDY)
    new_ref = make_engine(model=str(policy_v2), drafter="none").generate(prompts, GREEDY)
    assert [c.output_ids for c in old_ref] != [c.output_ids for c in new_ref]
    engine = make_engine(max_batch=4, fixed_draft_tokens=2)
    early = [engine.submit(p, GREEDY) for p in prompts[:2]]
    engine.step()
    engine.step()
    engine.request_swap(load_swap("policy", "p2", "drain", policy_v2, engine.target, plan=engine.plan))
    engine.step()
    assert engine.target_version == "p2" and set(engine.targets) == {"base", "p2"}
    late = [engine.submit(p, GREEDY) for p in prompts[2:]]
    _run(engine)
    assert [s.output_ids for s in early] == [c.output_ids for c in old_ref[:2]]
    assert [s.output_ids for s in late] == [c.output_ids for c in new_ref[2:]]
    assert [s.target_version for s in early + late] == ["base", "base", "p2", "p2"]
    assert set(engine.targets) == {"p2"}  # the old weights are released once nobody runs on them


def test_policy_interrupt_recomputes_and_records_versions(make_engine, tokenizer, policy_v2):
    [prompt] = chat_prompts(tokenizer, 1)
    engine = make_engine(fixed_draft_tokens=2)
    seq = engine.submit(prompt, GREEDY)
    while len(seq.output_ids) < 5:
        engine.step()
    engine.request_swap(load_swap("policy", "p2", "interrupt", policy_v2, engine.target, plan=engine.plan))
    engine.step()  # the swap lands at the end of this step
    prefix = list(seq.output_ids)
    _run(engine)
    # after the switch, the new policy continues greedily from the same context
    new_engine = make_engine(model=str(policy_v2), drafter="none")
    [cont] = new_engine.generate([prompt + prefix], SamplingParams(max_tokens=20 - len(prefix), temperature=0.0,
                                                                    ignore_eos=True))
    assert seq.output_ids == prefix + cont.output_ids
    assert [run[:2] for run in seq.version_runs] == [[0, "base"], [len(prefix), "p2"]]
    assert set(engine.targets) == {"p2"}


def test_second_swap_while_one_is_pending_is_refused(make_engine, tmp_path):
    engine = make_engine()
    EagleDrafter.day0(engine.target).save(tmp_path)
    engine.request_swap(load_swap("drafter", "d2", "drain", tmp_path, engine.target))
    with pytest.raises(SwapInProgressError, match="in progress"):
        engine.request_swap(load_swap("drafter", "d3", "drain", tmp_path, engine.target))


def test_mismatched_policy_is_refused_before_the_engine_sees_it(make_engine, policy_v2, tmp_path):
    engine = make_engine()
    bad = tmp_path / "bad"
    shutil.copytree(policy_v2, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SwapError, match="architecture"):
        load_swap("policy", "p3", "drain", bad, engine.target)
    truncated = tmp_path / "truncated"
    shutil.copytree(policy_v2, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SwapError, match="cannot load"):
        load_swap("policy", "p3", "drain", truncated, engine.target)
    assert engine.target_version == "base"


def test_a_float32_policy_swaps_into_an_int8_engine_quantized_at_load(make_engine, tokenizer, policy_v2, tmp_path):
    """The trainer publishes float32; an int8 server quantizes it while loading (off the decode path), serves
    it in int8 from the swap on, under the published version; a policy it cannot quantize (NaN) is refused
    with the old weights serving."""
    [prompt] = chat_prompts(tokenizer, 1)
    engine = make_engine(drafter="none", suffix_capacity=0, dtype="int8")  # one token a step: the swap lands mid-answer
    seq = engine.submit(prompt, GREEDY)
    while len(seq.output_ids) < 5:
        engine.step()
    swap = load_swap("policy", "p2", "interrupt", policy_v2, engine.target, plan=engine.plan)
    assert swap.model.layers[0].qkv.dtype == torch.int8 and swap.model.lm_head.dtype == torch.int8
    engine.request_swap(swap)
    engine.step()
    prefix = list(seq.output_ids)
    _run(engine)
    direct = make_engine(model=str(policy_v2), drafter="none", dtype="int8")  # policy_v2 served int8 from the start
    [cont] = direct.generate([prompt + prefix], SamplingParams(max_tokens=20 - len(prefix), temperature=0.0,
                                                               ignore_eos=True))
    assert seq.output_ids == prefix + cont.output_ids
    assert [run[:2] for run in seq.version_runs] == [[0, "base"], [len(prefix), "p2"]]
    assert {r.target_version for r in engine.sink.records} == {"base", "p2"}

    broken = tmp_path / "nan"
    shutil.copytree(policy_v2, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SwapError):
        load_swap("policy", "p3", "interrupt", broken, engine.target, plan=engine.plan)
    assert engine.target_version == "p2" and engine.target.layers[0].qkv.dtype == torch.int8
