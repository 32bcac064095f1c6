"""A synthetic task for the benchmark: integer prompts with fixed random conditioning and a linear reward.

The reward only has to be cheap, deterministic and spread within a group; the benchmark times the backbone.
"""
from __future__ import annotations

import torch

from leancompile.backbones import Backbone, Conditioning

NUM_PROMPTS = 8


class PromptEncoder:
    """Maps prompt ``i`` to row ``i`` of a conditioning table drawn once from ``seed``."""

    def __init__(self, backbone: Backbone, seed: int = 0):
        self.table = backbone.dummy_conditioning(NUM_PROMPTS, generator=torch.Generator().manual_seed(seed))

    def __call__(self, prompts) -> Conditioning:
        return self.table.index(torch.as_tensor(list(prompts)))


class ProjectionReward:
    """The sample's projection on a fixed random direction per prompt, so each prompt asks for something else."""

    def __init__(self, latent_shape: tuple[int, ...], seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.directions = torch.randn((NUM_PROMPTS, *latent_shape), generator=generator).flatten(1)

    def __call__(self, samples: torch.Tensor, prompts) -> torch.Tensor:
        directions = self.directions[torch.as_tensor(list(prompts))]
        return (samples.flatten(1) * directions).mean(1)
