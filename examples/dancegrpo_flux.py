"""A DanceGRPO-style training loop on Flux, written the way DanceGRPO's ``train_grpo_flux.py`` writes its own.

The transformer is a diffusers ``FluxTransformer2DModel`` with a guidance embedding (tiny, built from a config),
full fine-tuning with gradient checkpointing on. The rollout samples one image at a time under ``torch.no_grad()``
in the packed token space with image and text position ids and DanceGRPO's SDE step; the update draws, per sample,
a random subset of the steps to train (inside the update loop, after the rollout), runs micro-batch 1 and steps the
optimizer once per GRPO step.

Using leancompile changes one line (marked ``# leancompile``): every rollout call is kept (the update's steps are
not known yet) and each update call is served from the one with its inputs; under ``Config(schedule="reweight")``
three more lines hand the loss of the drawn steps to ``provisional`` and the rest are freed. Run
``python examples/dancegrpo_flux.py [--native]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import leancompile
from leancompile import backbones
from leancompile.trainers.sampling import dance_step, quantized_timestep, shifted_sigmas


@dataclass(frozen=True)
class Config:
    num_steps: int = 16
    timestep_fraction: float = 0.6
    guidance: float = 3.5
    eta: float = 0.3
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    prompts: int = 2
    group: int = 2
    seed: int = 0
    dtype: torch.dtype = torch.float32
    sizes: tuple = ()  # overrides of the tiny Flux config, as (key, value) pairs
    device: str = "cpu"
    schedule: str = "retain"  # leancompile's; "reweight" also hands it the update's loss once the steps are drawn


class Loop:
    """The model, its optimizer, prompts and reward: ``step()`` runs one rollout and its update."""

    def __init__(self, config: Config = Config(), use_leancompile: bool = True):
        self.config = c = config
        self.use_leancompile = use_leancompile
        base = backbones.tiny("flux", seed=c.seed, dtype=c.dtype, **dict(c.sizes))
        self.transformer = base.model.to(c.device)
        self.transformer.enable_gradient_checkpointing()
        self.optimizer = torch.optim.AdamW(self.transformer.parameters(), lr=1e-5, weight_decay=1e-4)
        if use_leancompile:
            self.transformer = leancompile.wrap(self.transformer, schedule=c.schedule)  # leancompile
        channels, height, width = base.latent_shape
        self.tokens = (height // 2) * (width // 2)
        self.channels = channels * 4  # 2x2 patches, packed as the Flux pipeline packs them
        rows = torch.arange(height // 2, dtype=torch.float32)[:, None].expand(height // 2, width // 2)
        cols = torch.arange(width // 2, dtype=torch.float32)[None, :].expand(height // 2, width // 2)
        self.img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(c.device)
        text = base.dummy_conditioning(c.prompts, torch.Generator().manual_seed(c.seed), dtype=c.dtype)
        self.embeds, self.pooled = text.text.to(c.device), text.pooled.to(c.device)
        self.txt_ids = torch.zeros(self.embeds.shape[1], 3, device=c.device)
        self.target = self.noise((self.tokens, self.channels), torch.Generator().manual_seed(c.seed + 1))
        self.sigmas = shifted_sigmas(c.num_steps, 3.0, c.dtype).to(c.device)
        self.generator = torch.Generator().manual_seed(c.seed)

    def noise(self, shape, generator=None) -> torch.Tensor:
        """Gaussian noise drawn on the CPU (the same on every device), on the loop's device."""
        c = self.config
        return torch.randn(shape, generator=generator or self.generator, dtype=c.dtype).to(c.device)

    def velocity(self, latents, sigma, prompt: int):
        """One transformer call as DanceGRPO makes it (a batch of one)."""
        return self.transformer(hidden_states=latents, encoder_hidden_states=self.embeds[prompt:prompt + 1],
                                pooled_projections=self.pooled[prompt:prompt + 1],
                                timestep=quantized_timestep(sigma).expand(1),
                                guidance=torch.full((1,), self.config.guidance, dtype=latents.dtype,
                                                    device=latents.device),
                                txt_ids=self.txt_ids, img_ids=self.img_ids, return_dict=False)[0]

    @torch.no_grad()
    def rollout(self) -> dict:
        """``group`` samples per prompt, one at a time; every step's latents and log-prob are kept."""
        c = self.config
        latents_all, log_probs_all = [], []
        for prompt in range(c.prompts):
            for _ in range(c.group):
                latents = self.noise((1, self.tokens, self.channels))
                trajectory, log_probs = [latents], []
                for i in range(c.num_steps):
                    v = self.velocity(latents, self.sigmas[i], prompt)
                    step = dance_step(latents, v, self.sigmas[i].expand(1), self.sigmas[i + 1].expand(1), c.eta,
                                      noise=self.noise(latents.shape))
                    latents = step.prev_sample
                    trajectory.append(latents)
                    log_probs.append(step.log_prob)
                latents_all.append(torch.cat(trajectory))
                log_probs_all.append(torch.cat(log_probs))
        return {"latents": torch.stack(latents_all), "log_probs": torch.stack(log_probs_all),
                "prompts": torch.arange(c.prompts).repeat_interleave(c.group)}

    def train(self, samples: dict, rewards: torch.Tensor) -> None:
        """Per sample, a random permutation of the steps (drawn here, after the rollout), its first
        ``timestep_fraction`` trained at micro-batch 1; one optimizer step for all of them."""
        c = self.config
        grouped = rewards.reshape(-1, c.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-8)).reshape(-1)
        trained = int((c.num_steps - 1) * c.timestep_fraction)
        perms = torch.stack([torch.randperm(c.num_steps - 1, generator=self.generator) for _ in rewards])
        steps = [(n, j) for n in range(len(rewards)) for j in perms[n, :trained].tolist()]
        if self.use_leancompile and c.schedule == "reweight":  # leancompile: the update's loss at one advantage
            self.transformer.provisional(lambda a: sum(self.loss(samples, torch.full_like(advantages, a), n, j)
                                                       for n, j in steps) / len(steps))
        for n, j in steps:
            (self.loss(samples, advantages, n, j) / len(steps)).backward()
        torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def loss(self, samples: dict, advantages: torch.Tensor, n: int, j: int) -> torch.Tensor:
        """Sample ``n``'s clipped loss at step ``j``."""
        c = self.config
        latents, next_latents = samples["latents"][n, j:j + 1], samples["latents"][n, j + 1:j + 2]
        v = self.velocity(latents, self.sigmas[j], int(samples["prompts"][n]))
        step = dance_step(latents, v, self.sigmas[j].expand(1), self.sigmas[j + 1].expand(1), c.eta,
                          prev_sample=next_latents)
        ratio = torch.exp(step.log_prob - samples["log_probs"][n, j])
        advantage = torch.clamp(advantages[n], -c.adv_clip_max, c.adv_clip_max)
        unclipped = -advantage * ratio
        clipped = -advantage * torch.clamp(ratio, 1 - c.clip_range, 1 + c.clip_range)
        return torch.mean(torch.maximum(unclipped, clipped))

    def step(self) -> float:
        """One GRPO step; returns the rollout's mean reward."""
        samples = self.rollout()
        rewards = -((samples["latents"][:, -1] - self.target) ** 2).mean(dim=(1, 2))
        self.train(samples, rewards)
        return float(rewards.mean())


if __name__ == "__main__":
    from loop_cli import run  # beside this script

    run(Loop, __doc__.splitlines()[0], steps=2)
