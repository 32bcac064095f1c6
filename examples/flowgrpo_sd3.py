"""A FlowGRPO-style training loop on SD3, written the way FlowGRPO's ``train_sd3.py`` writes its own.

The transformer is a diffusers ``SD3Transformer2DModel`` (tiny, built from a config) with a peft LoRA. The rollout is
a denoising loop under ``torch.no_grad()`` with classifier-free guidance by batch doubling and the SDE step with
its log-probability; the update calls the transformer again on the stored latents of every trained step, adds a
KL term to the adapter-disabled reference, and clips then steps the optimizer twice per rollout.

Using leancompile changes two lines of the loop (marked ``# leancompile``): the transformer is wrapped after the
optimizer is made, with the hint that the update trains the first ``train_steps`` steps of each batch; under ``Config(schedule="reweight")`` three more lines hand the loss of the micro-steps before
the first optimizer step to ``provisional``. Run ``python examples/flowgrpo_sd3.py [--native]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model

import leancompile
from leancompile import backbones
from leancompile.trainers.sampling import flow_sde_step, shifted_sigmas


@dataclass(frozen=True)
class Config:
    num_steps: int = 10
    train_steps: int = 9  # FlowGRPO's timestep_fraction 0.99: every step but the last
    guidance: float = 4.5
    noise_level: float = 0.7
    beta: float = 0.04  # the KL term's weight
    clip_range: float = 1e-4
    prompts: int = 2
    group: int = 2
    sample_batch: int = 4
    train_batch: int = 2
    optimizer_steps: int = 2  # per rollout
    seed: int = 0
    dtype: torch.dtype = torch.float32
    sizes: tuple = ()  # overrides of the tiny SD3 config, as (key, value) pairs
    device: str = "cpu"
    schedule: str = "retain"  # leancompile's; "reweight" also hands it the update's loss before the first step


class Loop:
    """The model, its optimizer, prompts and reward: ``step()`` runs one rollout and its update."""

    def __init__(self, config: Config = Config(), use_leancompile: bool = True):
        self.config = c = config
        self.use_leancompile = use_leancompile
        base = backbones.tiny("sd3", seed=c.seed, dtype=c.dtype, **dict(c.sizes))  # latents' and text's geometry
        torch.manual_seed(c.seed)
        lora = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                          target_modules=["to_q", "to_k", "to_v", "to_out.0"])
        self.transformer = get_peft_model(base.model, lora).to(c.device)
        self.optimizer = torch.optim.AdamW([p for p in self.transformer.parameters() if p.requires_grad], lr=1e-3)
        if use_leancompile:
            self.transformer = leancompile.wrap(self.transformer, schedule=c.schedule,  # leancompile
                                                trained=lambda n: n % c.num_steps < c.train_steps)  # leancompile
        text = base.dummy_conditioning(c.prompts + 1, torch.Generator().manual_seed(c.seed), dtype=c.dtype)
        text_embeds, pooled = text.text.to(c.device), text.pooled.to(c.device)
        self.embeds, self.pooled = text_embeds[1:], pooled[1:]
        self.negative = (text_embeds[:1], pooled[:1])
        self.latent_shape = base.latent_shape
        self.target = self.noise(base.latent_shape, torch.Generator().manual_seed(c.seed + 1))
        self.sigmas = shifted_sigmas(c.num_steps, 3.0, c.dtype).to(c.device)
        self.generator = torch.Generator().manual_seed(c.seed)

    def noise(self, shape, generator=None) -> torch.Tensor:
        """Gaussian noise drawn on the CPU (the same on every device), on the loop's device."""
        c = self.config
        return torch.randn(shape, generator=generator or self.generator, dtype=c.dtype).to(c.device)

    def guided(self, latents, timesteps, embeds, pooled):
        """The guided velocity: one transformer call on the doubled batch (unconditional rows first)."""
        neg_embeds, neg_pooled = self.negative
        noise_pred = self.transformer(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([timesteps] * 2),
                                      encoder_hidden_states=torch.cat([neg_embeds.expand_as(embeds), embeds]),
                                      pooled_projections=torch.cat([neg_pooled.expand_as(pooled), pooled]),
                                      return_dict=False)[0]
        uncond, text = noise_pred.chunk(2)
        return uncond + self.config.guidance * (text - uncond)

    @torch.no_grad()
    def rollout(self) -> dict:
        """``sample_batch`` samples per sampling batch; every step's latents, log-prob and timestep are kept."""
        c, batch = self.config, self.config.sample_batch
        samples = []
        for start in range(0, c.prompts * c.group, batch):
            rows = torch.arange(start, start + batch, device=c.device) // c.group
            latents = self.noise((batch, *self.latent_shape))
            all_latents, log_probs, timesteps = [latents], [], []
            for i in range(c.num_steps):
                t = (self.sigmas[i] * 1000).expand(batch)
                v = self.guided(latents, t, self.embeds[rows], self.pooled[rows])
                step = flow_sde_step(latents, v, self.sigmas[i].expand(batch), self.sigmas[i + 1].expand(batch),
                                     c.noise_level, noise=self.noise(latents.shape))
                latents = step.prev_sample
                all_latents.append(latents)
                log_probs.append(step.log_prob)
                timesteps.append(t)
            samples.append({"rows": rows, "latents": torch.stack(all_latents, 1),
                            "log_probs": torch.stack(log_probs, 1), "timesteps": torch.stack(timesteps, 1)})
        return {k: torch.cat([s[k] for s in samples]) for k in samples[0]}

    def loss(self, samples: dict, advantages: torch.Tensor, batch: slice, j: int) -> torch.Tensor:
        """The clipped loss of the samples ``batch`` at step ``j``, with the KL term to the reference."""
        c = self.config
        rows = samples["rows"][batch]
        latents, next_latents = samples["latents"][batch, j], samples["latents"][batch, j + 1]
        sigma, sigma_next = self.sigmas[j].expand(c.train_batch), self.sigmas[j + 1].expand(c.train_batch)
        timesteps = samples["timesteps"][batch, j]
        v = self.guided(latents, timesteps, self.embeds[rows], self.pooled[rows])
        step = flow_sde_step(latents, v, sigma, sigma_next, c.noise_level, prev_sample=next_latents)
        with torch.no_grad(), self.transformer.disable_adapter():
            v_ref = self.guided(latents, timesteps, self.embeds[rows], self.pooled[rows])
            reference = flow_sde_step(latents, v_ref, sigma, sigma_next, c.noise_level, prev_sample=next_latents)
        kl = ((step.mean - reference.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * step.std**2)
        ratio = torch.exp(step.log_prob - samples["log_probs"][batch, j])
        unclipped = -advantages[batch] * ratio
        clipped = -advantages[batch] * torch.clamp(ratio, 1 - c.clip_range, 1 + c.clip_range)
        return torch.mean(torch.maximum(unclipped, clipped)) + c.beta * kl.mean()

    def train(self, samples: dict, rewards: torch.Tensor) -> None:
        """One epoch over the samples: micro-batches of ``train_batch``, every trained step, the optimizer stepped
        ``optimizer_steps`` times."""
        c = self.config
        grouped = rewards.reshape(-1, c.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
        accumulation = (len(rewards) // c.train_batch) * c.train_steps // c.optimizer_steps
        params = [p for p in self.transformer.parameters() if p.requires_grad]
        micro = [(slice(start, start + c.train_batch), j) for start in range(0, len(rewards), c.train_batch)
                 for j in range(c.train_steps)]
        if self.use_leancompile and c.schedule == "reweight":  # leancompile: the update's loss at one advantage
            self.transformer.provisional(lambda a: sum(self.loss(samples, torch.full_like(advantages, a), b, j)
                                                       for b, j in micro[:accumulation]) / accumulation)
        for done, (batch, j) in enumerate(micro, 1):
            (self.loss(samples, advantages, batch, j) / accumulation).backward()
            if done % accumulation == 0:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad()

    def step(self) -> float:
        """One GRPO step; returns the rollout's mean reward."""
        self.transformer.eval()
        samples = self.rollout()
        rewards = -((samples["latents"][:, -1] - self.target) ** 2).mean(dim=(1, 2, 3))
        self.transformer.train()
        self.train(samples, rewards)
        return float(rewards.mean())


if __name__ == "__main__":
    from loop_cli import run  # beside this script

    run(Loop, __doc__.splitlines()[0], steps=2)
