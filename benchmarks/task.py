"""The benchmark's reward: a linear reward over the synthetic prompts of ``leancompile.tasks.synthetic``.

The reward only has to be cheap, deterministic and spread within a group; the benchmark times the backbone.
"""
from __future__ import annotations

import torch

NUM_PROMPTS = 8


class ProjectionReward:
    """The sample's projection on a fixed random direction per prompt, so each prompt asks for something else."""

    def __init__(self, latent_shape: tuple[int, ...], seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.directions = torch.randn((NUM_PROMPTS, *latent_shape), generator=generator).flatten(1)

    def __call__(self, samples: torch.Tensor, prompts) -> torch.Tensor:
        directions = self.directions[torch.as_tensor(list(prompts))].to(samples.device)
        return (samples.flatten(1) * directions).mean(1)
