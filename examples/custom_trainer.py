"""A user's own FlowGRPO variant: leancompile derives reuse from the traced programs, not from the class.

This trainer adds an advantage-free penalty on the velocity's magnitude to the loss. Nothing else changes:
``optimize`` still finds that the update recomputes the rollout's backbone call, and removes the re-forward where
it predicts that faster (at this tiny size, on the device's measured costs, it may run native and say why).

    python examples/custom_trainer.py
"""
import torch

import leancompile
from leancompile import backbones
from leancompile.tasks.synthetic import TINY_PROMPTS, RandomPrompts, latent_reward
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer


class VelocityPenaltyTrainer(FlowGRPOTrainer):
    penalty = 1e-3

    def micro_step_loss(self, micro):
        loss, info = super().micro_step_loss(micro)
        # A second call through the protocol's call site: the passes find that it, too, recomputes the rollout.
        velocity = self.train_velocity(micro)
        return loss + self.penalty * velocity.pow(2).mean(), info


def main() -> None:
    torch.set_num_threads(1)
    backbone = backbones.tiny("flux", seed=0)
    prompts = RandomPrompts(backbone)
    trainer = VelocityPenaltyTrainer(FlowGRPOConfig(num_steps=3, group_size=2), backbone, latent_reward, prompts)
    fast = leancompile.optimize(trainer)
    print(fast.plan)
    print(fast.step(list(TINY_PROMPTS)))


if __name__ == "__main__":
    main()
