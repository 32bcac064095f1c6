"""Trainers that are not ours: each differs from ``GRPOTrainer`` in one ordinary way a user would write. For each,
``optimize()`` under every schedule must give native's weight update (float64, 1e-10 relative), and where reuse
is legitimately possible some call must be served (refusing everything is not a pass)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leancompile import backbones, optimize
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer

from conftest import PromptTable, mean_reward


class CfgAsTwoCalls(FlowGRPOTrainer):
    """Classifier-free guidance in the update as two backbone calls, uncond then cond."""

    def train_velocity(self, micro):
        t = self.model_timestep(micro.sigma).to(micro.x.dtype)
        uncond = self.uncond.index(torch.zeros(len(micro.x), dtype=torch.long))
        v_uncond = self.backbone(micro.x, t, uncond)
        v_cond = self.backbone(micro.x, t, micro.cond)
        return v_uncond + self.config.guidance_scale * (v_cond - v_uncond)


class SecondCallInLoss(FlowGRPOTrainer):
    """The loss adds a term from a second backbone call at other inputs."""

    def micro_step_loss(self, micro):
        loss, info = super().micro_step_loss(micro)
        t = self.model_timestep(micro.sigma).to(micro.x.dtype)
        return loss + 0.1 * self.backbone(0.5 * micro.x, t, micro.cond).pow(2).mean(), info


class OwnSigma(FlowGRPOTrainer):
    """Its own rollout step hands the backbone a slightly different sigma than the update will."""

    def rollout_velocity(self, step, rows, x, sigma, cond):
        return super().rollout_velocity(step, rows, x, sigma * 0.999, cond)


class DirectOptimizerStep(FlowGRPOTrainer):
    """``update()`` steps the optimizer itself, one step per micro-batch, never calling ``optimizer_step()``."""

    def update(self, rollout, advantages):
        schedule = self.trained_step_schedule(rollout.num_samples, rollout.sde_steps)
        for rows in self.micro_batches(advantages):
            for j in range(self.config.num_trained_steps):
                loss, _ = self.micro_step_loss(self.micro_step(rollout, advantages, rows, schedule[rows, j]))
                (loss / self.config.num_trained_steps).backward()
            torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
        return {}


class StepEveryTrainedStep(FlowGRPOTrainer):
    """An optimizer step after every trained step."""

    def backward(self, loss, sync=True):
        super().backward(loss, sync)
        self.optimizer_step()

    def optimizer_step(self):
        if any(p.grad is not None for p in self.trainable):
            super().optimizer_step()


class TwoEpochsOneStep(FlowGRPOTrainer):
    """Two passes over the rollout accumulated into one optimizer step."""

    def update(self, rollout, advantages):
        for _ in range(2):
            schedule = self.trained_step_schedule(rollout.num_samples, rollout.sde_steps)
            for rows in self.micro_batches(advantages):
                for j in range(self.config.num_trained_steps):
                    loss, _ = self.micro_step_loss(self.micro_step(rollout, advantages, rows, schedule[rows, j]))
                    self.backward(loss / 4)
        self.optimizer_step()
        return {}


class RankAdvantages(FlowGRPOTrainer):
    """Its own advantages: centred ranks within each group, not normalised rewards."""

    def advantages(self, rewards):
        groups = rewards.view(-1, self.config.group_size)
        ranks = groups.argsort(dim=1).argsort(dim=1).to(self.dtype)
        return (ranks - ranks.mean(dim=1, keepdim=True)).flatten()


class ScaledHead(FlowGRPOTrainer):
    """The update scales the velocity after the shared call: the ratio is not 1, clipping can bind."""

    def train_velocity(self, micro):
        return 1.01 * super().train_velocity(micro)


class EvalRolloutDropoutUpdate(FlowGRPOTrainer):
    """Rollout in eval mode, update in train mode, with dropout (p = 0.1) after the first block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        block = self.backbone.model.transformer_blocks[0]
        block.register_forward_hook(lambda m, _, out: tuple(torch.nn.functional.dropout(o, 0.1, m.training)
                                                            if o is not None else o for o in out))

    def rollout(self, prompts):
        self.backbone.model.eval()
        try:
            return super().rollout(prompts)
        finally:
            self.backbone.model.train()


class WeightsMovedByReward(FlowGRPOTrainer):
    """The reward callback writes into a trainable weight (an in-place add, under no_grad)."""

    def __init__(self, config, backbone, reward_fn, *args, **kwargs):
        def moving_reward(samples, prompts):
            with torch.no_grad():
                self.trainable[0].add_(1e-3)
            return reward_fn(samples, prompts)

        super().__init__(config, backbone, moving_reward, *args, **kwargs)


class DataWriteToFrozenWeight(FlowGRPOTrainer):
    """Between rollout and update, a frozen weight is scaled through ``.data`` (no version counter moves)."""

    def advantages(self, rewards):
        frozen = next(p for p in self.backbone.parameters() if not p.requires_grad)
        frozen.data.mul_(1.01)
        return super().advantages(rewards)


class TwoCallsPerRolloutStep(FlowGRPOTrainer):
    """A sampler that calls the backbone twice per step (a Heun-like correction averaged in)."""

    def rollout_velocity(self, step, rows, x, sigma, cond):
        v = super().rollout_velocity(step, rows, x, sigma, cond)
        v2 = super().rollout_velocity(step, rows, x - 0.01 * v, sigma, cond)
        return v + 0.0 * v2


def batch_dependent_reward(samples, prompts):
    rewards = mean_reward(samples, prompts)
    return rewards - rewards.mean()


# deviation -> (trainer class, config overrides, reward, the schedules under which some call must be served)
ALL = frozenset({"retain", "reweight", "auto"})
DEVIATIONS = {
    "cfg as two calls": (CfgAsTwoCalls, dict(guidance_scale=2.0), mean_reward, ALL),
    "second call in the loss": (SecondCallInLoss, {}, mean_reward, ALL),
    "own sigma in the rollout": (OwnSigma, {}, mean_reward, frozenset()),
    "optimizer stepped directly": (DirectOptimizerStep, {}, mean_reward, ALL),
    "step after every trained step": (StepEveryTrainedStep, {}, mean_reward, ALL),
    "two epochs, one step": (TwoEpochsOneStep, {}, mean_reward, ALL),
    "own advantages": (RankAdvantages, {}, mean_reward, ALL),
    # Reweight: the ratio is not 1, a row serves only while its cotangent stays in the span (the clip may bind)
    "scaled head": (ScaledHead, {}, mean_reward, frozenset({"retain"})),
    "eval rollout, dropout update": (EvalRolloutDropoutUpdate, {}, mean_reward, frozenset()),
    "weights moved by the reward": (WeightsMovedByReward, {}, mean_reward, frozenset()),
    ".data write to a frozen weight": (DataWriteToFrozenWeight, {}, mean_reward, frozenset()),
    "two calls per rollout step": (TwoCallsPerRolloutStep, {}, mean_reward, ALL),
    "batch-dependent reward": (FlowGRPOTrainer, {}, batch_dependent_reward, ALL),
}


def _build(cls, config, reward):
    backbone = backbones.tiny("sd3", seed=config.seed, qk_norm=None)  # no float32 island: float64 throughout
    prompts = PromptTable(backbone, seed=config.seed)
    trainer = cls(config, backbone, reward, prompts, uncond=prompts.uncond if config.use_cfg else None)
    return trainer


def _flat(trainer):
    return torch.cat([p.detach().flatten().double() for p in trainer.trainable])


@given(deviation=st.sampled_from(sorted(DEVIATIONS)), schedule=st.sampled_from(["retain", "reweight", "auto"]),
       seed=st.integers(0, 50), beta=st.sampled_from([0.0, 0.05]))
@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_deviating_trainer_gets_native_weights(deviation, schedule, seed, beta):
    cls, overrides, reward, served_under = DEVIATIONS[deviation]
    config = FlowGRPOConfig(num_steps=3, timestep_fraction=0.67, group_size=2, train_batch_size=2,
                            gradient_accumulation_steps=2, dtype="float64", seed=seed, beta=beta,
                            **{"max_grad_norm": None, **overrides})
    native = _build(cls, config, reward)
    fast = optimize(_build(cls, config, reward), schedule)
    start = _flat(native)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the dropout deviation draws from the global generator
        native.step([1, 2])
        torch.manual_seed(seed)
        stats = fast.step([1, 2])
    update = _flat(native) - start
    error = float((_flat(fast) - start - update).norm() / update.norm())
    assert error <= 1e-10, f"{deviation} under {schedule}: relative error {error:.2e}; {getattr(fast, 'last_calls', [])}"
    if fast.plan.schedule != "native" and schedule in served_under:
        assert stats["served_calls"] > 0, f"{deviation} under {schedule}: nothing served; {fast.last_calls}"
    if not served_under:
        grad_calls = [r for r in getattr(fast, "last_calls", []) if r.action == "served"]
        assert not grad_calls, f"{deviation} under {schedule}: served {grad_calls}"


def test_every_served_call_says_why_and_every_recompute_names_its_reason():
    config = FlowGRPOConfig(num_steps=3, timestep_fraction=0.67, group_size=2, train_batch_size=2,
                            gradient_accumulation_steps=1, dtype="float64")
    fast = optimize(_build(FlowGRPOTrainer, config, mean_reward), "retain")
    stats = fast.step([1, 2])
    assert stats["served_calls"] == 2 and stats["recomputed_calls"] == 2  # the second optimizer step's calls
    assert stats["recompute_reasons"] == {"weights": 2}  # the second's kept calls were freed for the weights
    assert all(r.reason for r in fast.last_calls)


@pytest.mark.parametrize("schedule", ["retain", "reweight"])
def test_every_tensor_the_engine_makes_follows_the_trainers_device(schedule):
    """With the default device set to ``meta``, a tensor made without the trainer's device would be a meta tensor
    and fail the step loudly: compiling and running a step on the CPU proves none is."""
    config = FlowGRPOConfig(num_steps=3, timestep_fraction=0.67, group_size=2, train_batch_size=2,
                            gradient_accumulation_steps=2, guidance_scale=2.0, beta=0.05)
    trainer = _build(FlowGRPOTrainer, config, mean_reward)
    torch.set_default_device("meta")
    try:
        fast = optimize(trainer, schedule)
        stats = fast.step([1, 2])
    finally:
        torch.set_default_device(None)
    assert fast.plan.schedule == schedule and stats["served_calls"] > 0
    assert all(p.device.type == "cpu" for p in fast.trainable)
