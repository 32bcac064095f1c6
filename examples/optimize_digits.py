"""Compile a FlowGRPO trainer with leancompile, read its plan, and train a few steps on the digits task.

    python examples/optimize_digits.py
"""
import torch

import leancompile
from leancompile.tasks import digits
from leancompile.tasks.rewards import DigitsClassifierReward
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer


def main(steps: int = 3) -> None:
    torch.set_num_threads(1)
    model = digits.load_pretrained()
    config = FlowGRPOConfig(num_steps=6, timestep_fraction=0.5, group_size=8, train_batch_size=16,
                            gradient_accumulation_steps=2, guidance_scale=2.0, cfg_detach_uncond=True,
                            lora_rank=8, learning_rate=3e-3)
    trainer = FlowGRPOTrainer(config, model.backbone, DigitsClassifierReward(), model.encode,
                              uncond=model.encode([digits.NULL_CLASS]))
    fast = leancompile.optimize(trainer)
    print(fast.plan)
    for _ in range(steps):
        stats = fast.step([3, 5, 7, 9])
        held = stats["retained_bytes"] + stats["buffer_bytes"]  # activations (retain) or gradients (reweight)
        print(f"step {stats['step']}: reward {stats['reward_mean']:.3f}, {stats['step_seconds']:.2f} s, "
              f"{stats['served_calls']} backbone calls served by the rollout, {held / 2**20:.2f} MiB held")
    print(fast.explain().split("graphs:")[1])


if __name__ == "__main__":
    main()
