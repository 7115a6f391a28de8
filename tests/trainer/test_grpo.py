"""GRPO mechanics on the tiny model: advantages, staleness bound, NaN refusal, publishing."""

import pytest
import torch
import torch.nn.functional as F

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


def test_steps_raise_the_better_completion(trainer):
    good, bad = [11, 12, 13], [21, 22, 23]
    before = sum(logprobs(trainer.policy, PROMPT, good)) - sum(logprobs(trainer.policy, PROMPT, bad))
    for _ in range(5):
        stats = trainer.step([rollout(trainer, good, 1.0), rollout(trainer, bad, 0.0)])
        assert stats.trained == 2
    after = sum(logprobs(trainer.policy, PROMPT, good)) - sum(logprobs(trainer.policy, PROMPT, bad))
    assert after > before + 1.0


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
