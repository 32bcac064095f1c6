"""Loops written the way public GRPO scripts for flow models write theirs, at the benchmark's widened sizes: what
``python -m benchmarks --loops`` times natively and wrapped, and ``benchmarks.bf16_equivalence`` measures.

- ``FlowGRPOFluxLoop``: FlowGRPO's FLUX scripts (``train_flux.py``, ``train_flux_fast.py``). A diffusers Flux in
  bf16 with peft LoRA under bf16 autocast; the rollout in ``eval()`` under ``no_grad`` passes a bf16 ``timestep``
  and ``guidance`` and stores the trajectory stacked ``(batch, steps + 1, tokens, channels)`` in bf16; the update,
  in ``train()``, reads strided views ``latents[:, j]`` with float32 timesteps of equal value, shuffles the samples,
  and steps the optimizer ``optimizer_steps`` times per rollout. The same loop with one of ten steps trained, two
  optimizer steps and shuffled micro-batches is Flow-Factory's pattern.
- ``DanceGRPOWanLoop``: DanceGRPO's ``train_grpo_wan_2_1.py``. A diffusers Wan in bf16, fully fine-tuned, under
  bf16 autocast; one sample at a time, classifier-free guidance by concatenating the conditional and unconditional
  rows into one call of two; the first step's latents are bf16, the stored trajectory float32 (``torch.stack``
  promotes it), so the update's first call reads float32 latents of equal value; each sample's trained steps are
  drawn after the rollout, and one optimizer step follows them all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model

import leancompile
from leancompile import backbones
from leancompile.trainers.sampling import dance_step, flow_sde_step, shifted_sigmas


@dataclass(frozen=True)
class LoopSetup:
    """What every loop here shares: the backbone's sizes, the group, the sampler's noise, PPO's clipping."""

    sizes: tuple = ()  # overrides of the tiny backbone's config, as (key, value) pairs
    prompts: int = 2
    group: int = 2
    eta: float = 0.3
    guidance: float = 3.5
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    seed: int = 0
    device: str = "cpu"
    schedule: str = "retain"  # leancompile's, where the loop wraps its transformer


@dataclass(frozen=True)
class Setup(LoopSetup):
    """FlowGRPO's FLUX loop."""

    weights: str = "bf16"  # "bf16": bf16 weights; "fp32": float32 weights (both under bf16 autocast)
    num_steps: int = 4  # denoising steps
    train_steps: tuple = ()  # the steps the update trains, in order (empty: all)
    optimizer_steps: int = 1  # per rollout, each over its share of the samples
    micro_batch: int = 0  # samples per update call (0: the optimizer step's share at once)
    shuffle: bool = False  # the samples in a random order before they are split (FlowGRPO's per-epoch shuffle)
    group: int = 4
    eta: float = 0.7
    clip_range: float = 1e-5
    lora_rank: int = 4

    @property
    def trained(self) -> tuple:
        return self.train_steps or tuple(range(self.num_steps))


class FlowGRPOFlux:
    """FlowGRPO's FLUX rollout and first update on a tiny diffusers Flux with LoRA: ``transformer`` is what the
    loop calls (the peft model, wrapped or not)."""

    def __init__(self, setup: Setup, transformer, base: backbones.Backbone, conditioning):
        self.setup, self.transformer = setup, transformer
        s, device = setup, setup.device
        channels, height, width = base.latent_shape
        self.tokens, self.channels = (height // 2) * (width // 2), channels * 4  # 2x2 patches, packed
        rows = torch.arange(height // 2, dtype=torch.float32)[:, None].expand(height // 2, width // 2)
        cols = torch.arange(width // 2, dtype=torch.float32)[None, :].expand(height // 2, width // 2)
        self.img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(device)
        embeds, pooled = conditioning
        self.embeds = embeds.repeat_interleave(s.group, 0).to(device)  # the prompts' embeddings, a group each
        self.pooled = pooled.repeat_interleave(s.group, 0).to(device)
        self.txt_ids = torch.zeros(embeds.shape[1], 3, device=device)
        self.sigmas = shifted_sigmas(s.num_steps, 3.0, torch.float32).to(device)

    def call(self, latents, sigma, samples=slice(None)):
        """One transformer call as FlowGRPO's FLUX scripts make it, for ``samples``: ``sigma`` and the guidance in
        its dtype."""
        rows = latents.shape[0]
        return self.transformer(hidden_states=latents, encoder_hidden_states=self.embeds[samples],
                                pooled_projections=self.pooled[samples], timestep=sigma.expand(rows),
                                guidance=torch.full((rows,), self.setup.guidance, dtype=sigma.dtype,
                                                    device=sigma.device),
                                txt_ids=self.txt_ids, img_ids=self.img_ids, return_dict=False)[0]

    def rollout(self, noise):
        """Latents stacked as ``(batch, steps + 1, tokens, channels)`` in bf16, the old log-probs ``(batch, steps)``
        of the stored next latents, and each step's latents as the rollout's calls read them (contiguous)."""
        self.transformer.eval()
        latents, trajectory, log_probs = noise.bfloat16(), [noise.bfloat16()], []
        with torch.no_grad(), torch.autocast(self.setup.device, dtype=torch.bfloat16):
            for j in range(self.setup.num_steps):
                sigma, sigma_next = self.sigmas[j], self.sigmas[j + 1]
                v = self.call(latents, sigma.bfloat16()).float()
                step = flow_sde_step(latents.float(), v, sigma.expand(len(v)), sigma_next.expand(len(v)),
                                     self.setup.eta, noise=torch.randn(v.shape, generator=self.generator).to(v))
                latents = step.prev_sample.bfloat16()  # stored in the pipeline's dtype
                lp = flow_sde_step(trajectory[-1].float(), v, sigma.expand(len(v)), sigma_next.expand(len(v)),
                                   self.setup.eta, prev_sample=latents.float()).log_prob
                trajectory.append(latents)
                log_probs.append(lp)
        return torch.stack(trajectory, dim=1), torch.stack(log_probs, dim=1), trajectory

    def update(self, stacked, log_probs_old, advantages, samples=slice(None), contiguous=None):
        """One optimizer step's micro-step over ``samples``: each trained step's log-prob recomputed on
        ``stacked[:, j]`` (or on the rollout's own ``contiguous[j]``), PPO's clipped loss, one backward per step.
        ``stacked``, ``log_probs_old`` and ``advantages`` are the samples' own. Returns the ratios
        ``(samples, trained steps)``."""
        s = self.setup
        self.transformer.train()
        ratios = []
        timesteps = self.sigmas[:-1].expand(len(stacked), -1)  # stored as the sampler made them, float32
        with torch.autocast(s.device, dtype=torch.bfloat16):
            for j in s.trained:
                x = stacked[:, j] if contiguous is None else contiguous[j]
                x_next = stacked[:, j + 1] if contiguous is None else contiguous[j + 1]
                v = self.call(x, timesteps[:, j], samples).float()
                lp = flow_sde_step(x.float(), v, timesteps[:, j], self.sigmas[j + 1].expand(len(v)), s.eta,
                                   prev_sample=x_next.float()).log_prob
                ratio = torch.exp(lp - log_probs_old[:, j])
                unclipped = -advantages * ratio
                clipped = -advantages * torch.clamp(ratio, 1 - s.clip_range, 1 + s.clip_range)
                (torch.maximum(unclipped, clipped).mean() / len(s.trained)).backward()
                ratios.append(ratio.detach())
        return torch.stack(ratios, dim=1)


def advantages_of(rewards: torch.Tensor, setup: Setup) -> torch.Tensor:
    grouped = rewards.reshape(setup.prompts, setup.group)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-4)
    return adv.clamp(-setup.adv_clip_max, setup.adv_clip_max).flatten()


def flux_model(setup: Setup):
    """The tiny Flux with LoRA, its adapters drawn from ``setup.seed`` (B away from zero: A gets a gradient too)."""
    dtype = torch.bfloat16 if setup.weights == "bf16" else torch.float32
    base = backbones.tiny("flux", seed=setup.seed, dtype=dtype, **dict(setup.sizes))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(setup.seed + 1)
        model = get_peft_model(base.model, LoraConfig(r=setup.lora_rank, lora_alpha=setup.lora_rank,
                                                      init_lora_weights="gaussian",
                                                      target_modules=base.lora_target_modules()))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
    return base, model.to(setup.device)


class FlowGRPOFluxLoop:
    """FlowGRPO's FLUX training loop: ``step()`` runs one rollout and its update (``optimizer_steps`` optimizer
    steps over shares of the shuffled samples, in micro-batches)."""

    def __init__(self, setup: Setup = Setup(), use_leancompile: bool = True):
        self.config = s = setup
        base, model = flux_model(s)
        self.transformer = leancompile.wrap(model, schedule=s.schedule) if use_leancompile else model
        text = base.dummy_conditioning(s.prompts, torch.Generator().manual_seed(s.seed), torch.bfloat16)
        self.flow = FlowGRPOFlux(s, self.transformer, base, (text.text, text.pooled))
        self.flow.generator = self.generator = torch.Generator().manual_seed(s.seed + 2)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(self) -> float:
        s, flow = self.config, self.flow
        rows = s.prompts * s.group
        noise = torch.randn((rows, flow.tokens, flow.channels), generator=self.generator).to(s.device)
        stacked, log_probs, _ = flow.rollout(noise)
        rewards = -stacked[:, -1].float().square().mean(dim=(1, 2)).cpu()
        advantages = advantages_of(rewards, s).to(s.device)
        order = torch.randperm(rows, generator=self.generator) if s.shuffle else torch.arange(rows)
        for share in order.chunk(s.optimizer_steps):
            for samples in share.split(s.micro_batch or len(share)):
                at = samples.to(s.device)
                flow.update(stacked[at], log_probs[at], advantages[at], at)
            torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
        return float(rewards.mean())


@dataclass(frozen=True)
class WanSetup(LoopSetup):
    """DanceGRPO's Wan loop."""

    num_steps: int = 8
    timestep_fraction: float = 0.6  # of the steps, drawn per sample after the rollout
    guidance: float = 5.0


class DanceGRPOWanLoop:
    """DanceGRPO's Wan training loop: ``step()`` runs one rollout (a sample at a time, CFG rows concatenated) and
    its update (each sample's drawn steps, one optimizer step for all)."""

    def __init__(self, setup: WanSetup = WanSetup(), use_leancompile: bool = True):
        self.config = s = setup
        base = backbones.tiny("wan", seed=s.seed, dtype=torch.bfloat16, **dict(s.sizes))
        model = base.model.to(s.device)
        self.transformer = leancompile.wrap(model, schedule=s.schedule) if use_leancompile else model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=1e-4)
        self.latent_shape = base.latent_shape
        text = base.dummy_conditioning(s.prompts + 1, torch.Generator().manual_seed(s.seed), torch.bfloat16)
        self.embeds, self.negative = text.text[:-1].to(s.device), text.text[-1:].to(s.device)
        self.sigmas = shifted_sigmas(s.num_steps, 3.0, torch.float32).to(s.device)
        self.generator = torch.Generator().manual_seed(s.seed + 1)

    def velocity(self, latents, sigma, prompt: int):
        """The guided velocity from one call of two rows: the prompt's and the negative prompt's."""
        s = self.config
        with torch.autocast(s.device, dtype=torch.bfloat16):
            out = self.transformer(hidden_states=torch.cat([latents] * 2), timestep=(sigma * 1000).expand(2),
                                   encoder_hidden_states=torch.cat([self.embeds[prompt:prompt + 1], self.negative]),
                                   return_dict=False)[0].float()
        cond, uncond = out.chunk(2)
        return uncond + s.guidance * (cond - uncond)

    @torch.no_grad()
    def rollout(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.config
        self.transformer.eval()
        latents_all, log_probs_all = [], []
        for prompt in range(s.prompts):
            for _ in range(s.group):
                latents = torch.randn((1, *self.latent_shape), generator=self.generator).to(s.device).bfloat16()
                trajectory, log_probs = [latents], []
                for i in range(s.num_steps):
                    v = self.velocity(latents, self.sigmas[i], prompt)
                    noise = torch.randn(v.shape, generator=self.generator).to(v)
                    step = dance_step(latents.float(), v, self.sigmas[i].expand(1), self.sigmas[i + 1].expand(1),
                                      s.eta, noise=noise)
                    latents = step.prev_sample
                    trajectory.append(latents)
                    log_probs.append(step.log_prob)
                latents_all.append(torch.stack(trajectory, dim=1))  # promotes the bf16 first latents to float32
                log_probs_all.append(torch.stack(log_probs, dim=1))
        return torch.cat(latents_all), torch.cat(log_probs_all)

    def step(self) -> float:
        s = self.config
        latents, log_probs = self.rollout()
        rewards = -latents[:, -1].square().mean(dim=tuple(range(1, latents.dim() - 1))).cpu()
        grouped = rewards.reshape(-1, s.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-8)).reshape(-1)
        trained = int(s.num_steps * s.timestep_fraction)
        perms = [torch.randperm(s.num_steps, generator=self.generator)[:trained].tolist() for _ in rewards]
        self.transformer.train()
        for n, steps in enumerate(perms):
            for j in steps:
                v = self.velocity(latents[n:n + 1, j], self.sigmas[j], n // s.group)
                step = dance_step(latents[n:n + 1, j].float(), v, self.sigmas[j].expand(1),
                                  self.sigmas[j + 1].expand(1), s.eta, prev_sample=latents[n:n + 1, j + 1])
                ratio = torch.exp(step.log_prob - log_probs[n, j])
                advantage = advantages[n].clamp(-s.adv_clip_max, s.adv_clip_max).to(ratio)
                clipped = torch.clamp(ratio, 1 - s.clip_range, 1 + s.clip_range)
                (torch.maximum(-advantage * ratio, -advantage * clipped).mean() / (len(perms) * trained)).backward()
        torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(rewards.mean())
