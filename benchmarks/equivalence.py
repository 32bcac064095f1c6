"""End-to-end equivalence over a training run: native and ``optimize(trainer)`` (auto) train the digits model
side by side from the same seed; per-step rewards and the final weights are compared."""
from __future__ import annotations

import torch

from leancompile import optimize
from leancompile.tasks import digits
from leancompile.tasks.rewards import DigitsClassifierReward
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer

PROMPTS = [digits.NULL_CLASS] * 2


def config(precision: str) -> FlowGRPOConfig:
    """float64 (exact comparison) or bf16 autocast around the backbone over float32 weights."""
    numerics = {"float64": dict(dtype="float64"), "bf16": dict(dtype="float32", mixed_precision="bf16")}[precision]
    return FlowGRPOConfig(num_steps=4, timestep_fraction=0.5, noise_level=0.8, group_size=4, train_batch_size=4,
                          gradient_accumulation_steps=2, lora_rank=4, learning_rate=3e-3, seed=0, **numerics)


def _trainer(precision: str):
    model = digits.load_pretrained()
    return FlowGRPOTrainer(config(precision), model.backbone, DigitsClassifierReward(target=3), model.encode)


def _weights(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in trainer.trainable])


def train_side_by_side(steps: int, precision: str = "float64") -> dict:
    """Train native and auto for ``steps`` GRPO steps; the weights' error is relative to native's total update."""
    native, auto = _trainer(precision), optimize(_trainer(precision))
    start = _weights(native)
    rewards = {"native": [], "auto": []}
    reused = 0
    for _ in range(steps):
        n, a = native.step(PROMPTS), auto.step(PROMPTS)
        rewards["native"].append(n["reward_mean"])
        rewards["auto"].append(a["reward_mean"])
        reused += a["served_calls"]
    update = _weights(native) - start
    return {"precision": precision, "steps": steps, "auto_runs": auto.plan.schedule,
            "served_calls": reused, "rewards_native": rewards["native"], "rewards_auto": rewards["auto"],
            "max_reward_diff": max(abs(x - y) for x, y in zip(rewards["native"], rewards["auto"])),
            "weight_rel_error": float((_weights(native) - _weights(auto)).norm() / update.norm())}
