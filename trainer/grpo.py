"""GRPO on the trainer's own copy of the policy.

For each group of G completions of one prompt, rewards r_i become advantages
A_i = (r_i - mean r) / (std r + eps) (a group whose rewards are all equal teaches nothing and is
skipped). Each completion token t contributes the clipped surrogate
    -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A),   ratio_t = exp(log pi(t) - log mu(t)),
where log mu(t) is the log-prob the server recorded when it sampled the token (the behaviour
policy, whatever version produced it), plus beta * KL(pi || reference) with the k3 estimator
exp(ref - log pi) - (ref - log pi) - 1. Token losses are averaged per completion, completions
averaged over the batch. Rollouts are sampled at temperature 1 with top_p 1 so that the recorded
log-probs are the policy's own distribution.

Precision: the weights, the gradients and AdamW's moments are float32; the forward and backward run under
bfloat16 autocast where the CPU has native bf16 dot products (`GRPOConfig.compute`, "auto"): the server
serves bfloat16 weights there already, so the behaviour log-probs carry bfloat16's rounding either way, and
a step takes about half the time (8 completions of 200 tokens, 1 thread, AMX Xeon: 13.8 s against 25.3 s
in float32). Log-softmax and the loss are float32.

Restart safety: with a `state_path`, every publish also checkpoints the trainer (policy, AdamW
moments, step count, the published versions), and a new trainer on the same path resumes from it.
Rollouts are not kept: they are produced on-policy and a restarted run samples new ones, so what
a crash loses is the optimizer steps since the last publish (never a published version). If the
crash fell between a publish and its checkpoint, the store holds a version whose parent is the
checkpoint's newest: the trainer resumes on that version's weights (the moments are one step older).

Staleness: a rollout whose oldest token came from a policy more than `max_lag` published versions
behind the newest is never trained on (counted as stale). Rollouts cut by an `interrupt` swap
carry per-token versions; they are kept when their oldest version is within the bound, and the
per-token recorded log-probs keep the importance ratio exact.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specrl.errors import SpecrlError
from specrl.models.calibration import cpu_info, resolve_dtype
from specrl.models.llama import TensorSource, load_llama
from specrl.trainer.checkpoint import save_checkpoint
from specrl.weights import WeightsStore

log = logging.getLogger("specrl.trainer.grpo")


@dataclass
class Rollout:
    group: int  # rollouts of one prompt share a group
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each token, recorded by the server
    versions: list[list]  # [first token index, policy version, drafter version] runs
    reward: float = 0.0
    text: str = ""
    score_error: str | None = None

    @property
    def oldest_version(self) -> str | None:
        return self.versions[0][1] if self.versions else None


@dataclass
class GRPOConfig:
    lr: float = 2e-6
    clip: float = 0.2
    beta: float = 0.02
    max_lag: int = 1
    max_grad_norm: float = 1.0
    compute: str = "auto"   # "float32" | "bfloat16" (autocast) | "auto": bfloat16 where the CPU has native bf16


@dataclass
class StepStats:
    loss: float
    mean_reward: float
    trained: int
    stale: int
    flat_groups: int                   # groups whose rewards were all equal: no advantage, not trained on
    groups: int = 0                    # groups within the staleness bound
    versions: dict = field(default_factory=dict)


class GRPOTrainer:
    def __init__(self, model_dir: Path, config: GRPOConfig, base_version: str = "base",
                 state_path: Path | None = None, store: WeightsStore | None = None):
        """`state_path`: checkpoint file, resumed from when it exists; `store`: where the policy is
        published (needed to resume past a publish the checkpoint missed)."""
        self.model_dir, self.config = Path(model_dir), config
        self.autocast_bf16 = autocast_bf16(config.compute)   # an unknown value fails before any load
        self.policy = load_llama(model_dir)
        self.policy.requires_grad_(True)
        self.reference = load_llama(model_dir) if config.beta > 0 else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=config.lr, weight_decay=0.0)
        self.published = [base_version]  # policy versions in publish order: the lag ruler
        self.steps = 0
        self.state_path = Path(state_path) if state_path else None
        if self.state_path is not None and self.state_path.is_file():
            self._resume(store)

    @property
    def version(self) -> str:
        return self.published[-1]

    def lag(self, version: str | None) -> int:
        return len(self.published) - 1 - self.published.index(version) if version in self.published else 10 ** 6

    def step(self, rollouts: list[Rollout]) -> StepStats:
        fresh = [r for r in rollouts if self.lag(r.oldest_version) <= self.config.max_lag and r.token_ids]
        groups: dict[int, list[Rollout]] = {}
        for r in fresh:
            groups.setdefault(r.group, []).append(r)
        batch, flat = [], 0
        for members in groups.values():
            rewards = torch.tensor([r.reward for r in members])
            if len(members) < 2 or float(rewards.std()) < 1e-6:
                flat += 1
                continue
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            batch += list(zip(members, advantages.tolist()))
        stats = StepStats(float("nan"), _mean([r.reward for r in rollouts]), len(batch), len(rollouts) - len(fresh),
                          flat, len(groups))
        if not batch:
            return stats
        self.policy.train()
        self.optimizer.zero_grad()
        total = 0.0
        for rollout, advantage in batch:  # one completion at a time bounds memory (V = 49k logits per token)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast_bf16):
                loss = self._completion_loss(rollout, advantage) / len(batch)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        stats.loss = total
        return stats

    def _completion_loss(self, rollout: Rollout, advantage: float) -> torch.Tensor:
        tokens = torch.tensor(rollout.prompt_ids + rollout.token_ids)[None]
        n, start = len(rollout.token_ids), len(rollout.prompt_ids)
        targets = tokens[0, start:]
        logits = self.policy.logits(self.policy(tokens)[0, start - 1: start - 1 + n])
        new = F.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
        ratio = torch.exp(new - torch.tensor(rollout.logprobs[:n]))
        clipped = torch.clamp(ratio, 1 - self.config.clip, 1 + self.config.clip)
        loss = -torch.min(ratio * advantage, clipped * advantage)
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference.logits(self.reference(tokens)[0, start - 1: start - 1 + n])
                ref = F.log_softmax(ref_logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
            loss = loss + self.config.beta * (torch.exp(ref - new) - (ref - new) - 1)
        return loss.mean()

    def weights_are_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.policy.parameters())

    def publish(self, store: WeightsStore, metrics: dict) -> str:
        """Write the policy as an HF directory into the store. Refuses non-finite weights."""
        if not self.weights_are_finite():
            raise FloatingPointError("the policy update produced NaN/inf weights; not publishing")
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("config.json", "generation_config.json"):
                if (self.model_dir / name).is_file():
                    shutil.copy(self.model_dir / name, Path(tmp) / name)
            save_file(self.policy.hf_state(), str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            manifest = store.publish("policy", tmp, parent=self.version, metrics=metrics,
                                     architecture={"model": "llama"})
        self.published.append(manifest.version)
        self.save_state()
        return manifest.version

    def save_state(self) -> None:
        """Checkpoint (atomic rename): policy, optimizer moments, step count, published versions."""
        if self.state_path is None:
            return
        save_checkpoint({"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                         "steps": self.steps, "published": self.published}, self.state_path)

    def _resume(self, store: WeightsStore | None) -> None:
        state = torch.load(self.state_path, weights_only=False)
        try:
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise SpecrlError(f"the policy trainer state {self.state_path} does not fit this model "
                              f"({str(exc).splitlines()[0]}): move it away, or use another --deployment") from None
        self.steps, self.published = state["steps"], list(state["published"])
        children = [m.version for m in store.versions("policy") if m.parent == self.version] if store else []
        if children:  # published, then killed before the checkpoint: that version is this trainer's newest
            self.policy.load_hf_state(TensorSource.from_dir(store.verify("policy", children[-1])))
            self.published.append(children[-1])
        log.info("event=resume state=%s steps=%d policy=%s", self.state_path, self.steps, self.version)


def autocast_bf16(compute: str) -> bool:
    """`GRPOConfig.compute` -> whether the policy's forward and backward run under bfloat16 autocast."""
    if compute not in ("auto", "float32", "bfloat16"):
        raise SpecrlError(f"GRPO compute must be auto, float32 or bfloat16; got {compute!r}")
    if compute == "auto":  # the serving dtype's own rule: bfloat16 where the CPU has native bf16 dot products
        return resolve_dtype("auto", cpu_info()[1])[0] == torch.bfloat16
    return compute == "bfloat16"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
