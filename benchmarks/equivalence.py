"""End-to-end equivalence over a training run: native and ``optimize(trainer)`` (auto) train the digits model
side by side from the same seed; per-step rewards and the final weights are compared, and with ``bitwise`` the
rewards and weights are compared bit for bit after every step."""
from __future__ import annotations

import torch

from leancompile import optimize
from leancompile.tasks import digits
from leancompile.tasks.rewards import DigitsClassifierReward
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer

PROMPTS = [digits.NULL_CLASS] * 2
# The bitwise runs: class prompts with guidance (two rows per call, the prompt's and the null class's).
BITWISE_PROMPTS = [3, 7]


def config(precision: str, batch_of_one: bool = False) -> FlowGRPOConfig:
    """float64 (exact comparison), float32, or bf16 autocast around the backbone over float32 weights.
    ``batch_of_one``: the rollout and the update both one sample per call (DanceGRPO's batching) with guidance,
    the same optimizer step per rollout: the batching under which bitwise Retain serves every call."""
    numerics = {"float64": dict(dtype="float64"), "float32": dict(dtype="float32"),
                "bf16": dict(dtype="float32", mixed_precision="bf16")}[precision]
    batching = (dict(sample_batch_size=1, train_batch_size=1, gradient_accumulation_steps=8, guidance_scale=2.0)
                if batch_of_one
                else dict(train_batch_size=4, gradient_accumulation_steps=2))
    return FlowGRPOConfig(num_steps=4, timestep_fraction=0.5, noise_level=0.8, group_size=4, lora_rank=4,
                          learning_rate=3e-3, seed=0, **batching, **numerics)


def _trainer(precision: str, batch_of_one: bool = False):
    model = digits.load_pretrained()
    uncond = model.encode([digits.NULL_CLASS]) if batch_of_one else None
    return FlowGRPOTrainer(config(precision, batch_of_one), model.backbone, DigitsClassifierReward(target=3),
                           model.encode, uncond=uncond)


def _weights(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in trainer.trainable])


def train_side_by_side(steps: int, precision: str = "float64", bitwise: bool = False) -> dict:
    """Train native and auto for ``steps`` GRPO steps; the weights' error is relative to native's total update.
    ``bitwise``: auto with ``bitwise=True`` at a batch of one; ``bitwise_steps`` counts the steps after which the
    rewards and every weight were bitwise native's."""
    native, auto = _trainer(precision, bitwise), optimize(_trainer(precision, bitwise), bitwise=bitwise)
    start = _weights(native)
    rewards = {"native": [], "auto": []}
    reused = same = 0
    prompts = BITWISE_PROMPTS if bitwise else PROMPTS
    for _ in range(steps):
        n, a = native.step(prompts), auto.step(prompts)
        rewards["native"].append(n["reward_mean"])
        rewards["auto"].append(a["reward_mean"])
        reused += a["served_calls"]
        same += (torch.equal(native.last_rollout.rewards, auto.last_rollout.rewards)
                 and all(torch.equal(x, y) for x, y in zip(native.trainable, auto.trainable)))
    update = _weights(native) - start
    return {"precision": precision + (", bitwise" if bitwise else ""), "steps": steps, "auto_runs": auto.plan.schedule,
            "served_calls": reused, "bitwise_steps": same,
            "rewards_native": rewards["native"], "rewards_auto": rewards["auto"],
            "max_reward_diff": max(abs(x - y) for x, y in zip(rewards["native"], rewards["auto"])),
            "weight_rel_error": float((_weights(native) - _weights(auto)).norm() / update.norm())}
