"""GRPO mechanics on the tiny model: advantages, staleness bound, NaN refusal, publishing."""

import pytest
import torch
import torch.nn.functional as F

from specrl.errors import SpecrlError
from specrl.models.llama import load_llama
from specrl.trainer.grpo import GRPOConfig, GRPOTrainer, Rollout
from specrl.weights import WeightsStore

PROMPT = [1, 500, 600, 700]


def logprobs(model, prompt, tokens):
    with torch.no_grad():
        ids = torch.tensor(prompt + tokens)[None]
        logits = model.logits(model(ids)[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)])
        return F.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def rollout(trainer, tokens, reward, version="base", group=0):
    return Rollout(group, PROMPT, tokens, logprobs(trainer.policy, PROMPT, tokens), [[0, version, "day0"]], reward)


@pytest.fixture
def trainer(tiny_dir):
    return GRPOTrainer(tiny_dir, GRPOConfig(lr=1e-3, beta=0.02))


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_steps_raise_the_better_completion(tiny_dir, compute):
    trainer = GRPOTrainer(tiny_dir, GRPOConfig(lr=1e-3, beta=0.02, compute=compute))
    assert trainer.autocast_bf16 == (compute == "bfloat16")
    good, bad = [11, 12, 13], [21, 22, 23]
    before = sum(logprobs(trainer.policy, PROMPT, good)) - sum(logprobs(trainer.policy, PROMPT, bad))
    for _ in range(5):
        stats = trainer.step([rollout(trainer, good, 1.0), rollout(trainer, bad, 0.0)])
        assert stats.trained == 2
    after = sum(logprobs(trainer.policy, PROMPT, good)) - sum(logprobs(trainer.policy, PROMPT, bad))
    assert after > before + 1.0
    # autocast computes in bfloat16; the weights (and AdamW's moments) it updates stay float32
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())


def test_an_unknown_compute_is_refused(tiny_dir):
    with pytest.raises(SpecrlError, match="auto, float32 or bfloat16"):
        GRPOTrainer(tiny_dir, GRPOConfig(compute="float8"))


def test_flat_groups_teach_nothing(trainer):
    stats = trainer.step([rollout(trainer, [5, 6], 1.0), rollout(trainer, [7, 8], 1.0)])
    assert stats.trained == 0 and stats.flat_groups == 1 and trainer.steps == 0


def test_rollouts_beyond_the_staleness_bound_are_never_trained(trainer, tmp_path):
    store = WeightsStore(tmp_path)
    trainer.publish(store, {})
    trainer.publish(store, {})  # published: base, v1, v2 -> base is 2 versions behind
    assert trainer.config.max_lag == 1 and trainer.lag("base") == 2
    stale = [rollout(trainer, [5, 6], 1.0, "base"), rollout(trainer, [7, 8], 0.0, "base")]
    before = [p.clone() for p in trainer.policy.parameters()]
    stats = trainer.step(stale)
    assert stats.stale == 2 and stats.trained == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    fresh = [rollout(trainer, [5, 6], 1.0, "v1"), rollout(trainer, [7, 8], 0.0, "v2")]
    assert trainer.step(fresh).trained == 2


def test_non_finite_weights_are_refused(trainer, tmp_path):
    with torch.no_grad():
        trainer.policy.layers[0].down[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN"):
        trainer.publish(WeightsStore(tmp_path), {})
    assert WeightsStore(tmp_path).versions("policy") == []


def test_published_policy_loads_back(trainer, tmp_path, tiny_dir):
    trainer.step([rollout(trainer, [11, 12], 1.0), rollout(trainer, [21, 22], 0.0)])
    store = WeightsStore(tmp_path)
    version = trainer.publish(store, {"step": 1})
    loaded = load_llama(store.verify("policy", version))
    for (name, a), b in zip(trainer.policy.named_parameters(), loaded.parameters()):
        assert torch.equal(a.detach(), b), name
    assert store.manifest("policy", version).parent == "base"


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.policy.parameters(), b.policy.parameters()))


def test_a_restarted_trainer_resumes_from_its_last_publish(tiny_dir, tmp_path):
    """Policy, optimizer moments, step count and published versions survive a restart; steps after
    the last publish are what a crash loses."""
    store, state = WeightsStore(tmp_path / "store"), tmp_path / "grpo.pt"
    first = GRPOTrainer(tiny_dir, GRPOConfig(lr=1e-3), state_path=state, store=store)
    good, bad = [11, 12, 13], [21, 22, 23]
    first.step([rollout(first, good, 1.0), rollout(first, bad, 0.0)])
    version = first.publish(store, {})
    resumed = GRPOTrainer(tiny_dir, GRPOConfig(lr=1e-3), state_path=state, store=store)
    assert resumed.published == ["base", version] and resumed.steps == 1 and _same_weights(first, resumed)
    moments = [resumed.optimizer.state[p]["exp_avg"] for p in resumed.policy.parameters()]
    assert all(torch.equal(m, first.optimizer.state[p]["exp_avg"]) for m, p in zip(moments, first.policy.parameters()))
    # both take the same next step from the same state
    first.step([rollout(first, good, 1.0, version), rollout(first, bad, 0.0, version)])
    resumed.step([rollout(resumed, good, 1.0, version), rollout(resumed, bad, 0.0, version)])
    assert _same_weights(first, resumed)
    # an unpublished step is lost: a restart goes back to the published policy
    again = GRPOTrainer(tiny_dir, GRPOConfig(lr=1e-3), state_path=state, store=store)
    assert again.steps == 1 and not _same_weights(first, again)


def test_a_publish_the_checkpoint_missed_is_resumed_from_the_store(tiny_dir, tmp_path):
    store, state = WeightsStore(tmp_path / "store"), tmp_path / "grpo.pt"
    first = GRPOTrainer(tiny_dir, GRPOConfig(lr=1e-3), state_path=state, store=store)
    first.step([rollout(first, [11, 12], 1.0), rollout(first, [21, 22], 0.0)])
    v1 = first.publish(store, {})
    older = state.read_bytes()
    first.step([rollout(first, [11, 12], 1.0, v1), rollout(first, [21, 22], 0.0, v1)])
    v2 = first.publish(store, {})
    state.write_bytes(older)  # killed after publishing v2, before its checkpoint
    resumed = GRPOTrainer(tiny_dir, GRPOConfig(lr=1e-3), state_path=state, store=store)
    assert resumed.published == ["base", v1, v2] and resumed.version == v2
    assert _same_weights(first, resumed)


def test_a_state_for_another_model_is_a_clear_error(tiny_dir, tmp_path):
    state = tmp_path / "grpo.pt"
    torch.save({"policy": {"embed": torch.zeros(3, 3)}, "optimizer": {}, "steps": 0, "published": ["base"]}, state)
    with pytest.raises(SpecrlError, match="does not fit this model"):
        GRPOTrainer(tiny_dir, GRPOConfig(), state_path=state)
