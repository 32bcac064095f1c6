"""A synthetic task on any backbone: integer prompts with fixed random conditioning and a cheap reward.

Used wherever a trainer is needed without the digits model: the ``tiny-report`` command, the benchmark and the
tests. The reward is prompt-dependent and spread within every group, so advantages and gradients are non-zero.
"""
from __future__ import annotations

import torch

from ..backbones import Backbone, Conditioning

TINY_PROMPTS = (1, 2)


class RandomPrompts:
    """Maps prompt ``i`` to row ``i`` of a conditioning table drawn once from ``seed``; row 0 is the negative
    prompt used for classifier-free guidance."""

    def __init__(self, backbone: Backbone, num: int = 8, seed: int = 0):
        self.table = backbone.dummy_conditioning(num, generator=torch.Generator().manual_seed(seed))

    def __call__(self, prompts) -> Conditioning:
        return self.table.index(torch.as_tensor(list(prompts), device=self.table.text.device))

    @property
    def uncond(self) -> Conditioning:
        return self.table.index(torch.tensor([0], device=self.table.text.device))


def latent_reward(samples: torch.Tensor, prompts) -> torch.Tensor:
    """``mean(x) * (prompt + 1) + std(x)``: deterministic, prompt-dependent, different for every sample."""
    scale = torch.tensor([1.0 + float(p) for p in prompts], device=samples.device)
    flat = samples.flatten(1)
    return flat.mean(1) * scale + flat.std(1)


def build_tiny_trainer(backbone: str = "sd3", algorithm: str = "flowgrpo", guidance_scale: float = 1.0,
                       seed: int = 0):
    """A native trainer on a tiny random ``backbone`` (flux, sd3 or wan): a few seconds per step on a CPU. A
    ``guidance_scale`` above 1 trains with classifier-free guidance."""
    from .. import backbones
    from ..trainers import trainer_class as native

    trainer_class = native(algorithm)
    cfg = guidance_scale > 1
    config = trainer_class.config_class(num_steps=3, group_size=2, guidance_scale=guidance_scale, seed=seed)
    model = backbones.tiny(backbone, seed=seed)
    prompts = RandomPrompts(model, seed=seed)
    return trainer_class(config, model, latent_reward, prompts, uncond=prompts.uncond if cfg else None)


def optimized_tiny_trainer(backbone: str = "sd3", algorithm: str = "flowgrpo", schedule: str = "auto",
                           guidance_scale: float = 1.0, seed: int = 0):
    """``optimize()`` applied to :func:`build_tiny_trainer`; its first ``step(TINY_PROMPTS)`` adds the partition
    graphs of the backbone to ``.graphs``."""
    from ..api import optimize

    return optimize(build_tiny_trainer(backbone, algorithm, guidance_scale, seed), schedule=schedule)
