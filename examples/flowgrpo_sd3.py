"""A FlowGRPO-style training loop on SD3, written the way FlowGRPO's ``train_sd3.py`` writes its own.

The transformer is a diffusers ``SD3Transformer2DModel`` (tiny, built from a config) with a peft LoRA. The rollout is
a denoising loop under ``torch.no_grad()`` with classifier-free guidance by batch doubling and the SDE step with
its log-probability; the update calls the transformer again on the stored latents of every trained step, adds a
KL term to the adapter-disabled reference, and clips then steps the optimizer twice per rollout.

Using leancompile changes one line of the loop (marked ``# leancompile``): the transformer is wrapped after the
optimizer is made. Run ``python examples/flowgrpo_sd3.py [--native]``.
"""
from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model

import leancompile
from leancompile import backbones
from leancompile.trainers.sampling import flow_sde_step, shifted_sigmas

NUM_STEPS, GUIDANCE, NOISE_LEVEL, BETA, CLIP_RANGE = 10, 4.5, 0.7, 0.04, 1e-4
PROMPTS, GROUP, SAMPLE_BATCH, TRAIN_BATCH = 2, 2, 4, 2
TRAIN_STEPS = NUM_STEPS - 1  # FlowGRPO's timestep_fraction 0.99 trains every step but the last


def build(seed: int = 0, dtype=torch.float32, leancompile_wrap: bool = True):
    """The transformer (wrapped or not), its optimizer, the prompt embeddings and a reward."""
    base = backbones.tiny("sd3", seed=seed, dtype=dtype)  # the geometry of the latents and the text
    torch.manual_seed(seed)
    transformer = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                                         target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-3)
    if leancompile_wrap:
        transformer = leancompile.wrap(transformer)  # leancompile
    text = base.dummy_conditioning(PROMPTS + 1, torch.Generator().manual_seed(seed), dtype=dtype)
    embeds = {"prompt": (text.text[1:], text.pooled[1:]), "negative": (text.text[:1], text.pooled[:1])}
    target = torch.randn(base.latent_shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    reward = lambda latents: -((latents - target) ** 2).mean(dim=(1, 2, 3))  # noqa: E731
    return transformer, optimizer, embeds, base.latent_shape, reward


def guided(transformer, latents, timesteps, embeds, pooled, negative):
    """The guided velocity: one transformer call on the doubled batch (unconditional rows first)."""
    neg_embeds, neg_pooled = negative
    noise_pred = transformer(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([timesteps] * 2),
                             encoder_hidden_states=torch.cat([neg_embeds.expand_as(embeds), embeds]),
                             pooled_projections=torch.cat([neg_pooled.expand_as(pooled), pooled]),
                             return_dict=False)[0]
    uncond, text = noise_pred.chunk(2)
    return uncond + GUIDANCE * (text - uncond)


@torch.no_grad()
def rollout(transformer, embeds, latent_shape, generator, dtype):
    """``SAMPLE_BATCH`` samples per sampling batch; every step's latents, log-prob and timestep are kept."""
    prompt_embeds, pooled = embeds["prompt"]
    sigmas = shifted_sigmas(NUM_STEPS, 3.0, dtype)
    samples = []
    for start in range(0, PROMPTS * GROUP, SAMPLE_BATCH):
        rows = torch.arange(start, start + SAMPLE_BATCH) // GROUP
        latents = torch.randn((SAMPLE_BATCH, *latent_shape), generator=generator, dtype=dtype)
        all_latents, log_probs, timesteps = [latents], [], []
        for i in range(NUM_STEPS):
            t = (sigmas[i] * 1000).expand(SAMPLE_BATCH)
            v = guided(transformer, latents, t, prompt_embeds[rows], pooled[rows], embeds["negative"])
            noise = torch.randn(latents.shape, generator=generator, dtype=dtype)
            step = flow_sde_step(latents, v, sigmas[i].expand(SAMPLE_BATCH), sigmas[i + 1].expand(SAMPLE_BATCH),
                                 NOISE_LEVEL, noise=noise)
            latents = step.prev_sample
            all_latents.append(latents)
            log_probs.append(step.log_prob)
            timesteps.append(t)
        samples.append({"rows": rows, "latents": torch.stack(all_latents, 1), "log_probs": torch.stack(log_probs, 1),
                        "timesteps": torch.stack(timesteps, 1)})
    return {k: torch.cat([s[k] for s in samples]) for k in samples[0]}


def train(transformer, optimizer, embeds, samples, rewards, dtype):
    """One epoch over the samples: micro-batches of ``TRAIN_BATCH``, every trained step, two optimizer steps."""
    grouped = rewards.reshape(-1, GROUP)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    prompt_embeds, pooled = embeds["prompt"]
    sigmas = shifted_sigmas(NUM_STEPS, 3.0, dtype)
    micro_steps = (len(rewards) // TRAIN_BATCH) * TRAIN_STEPS
    accumulation = micro_steps // 2
    params = [p for p in transformer.parameters() if p.requires_grad]
    done = 0
    for start in range(0, len(rewards), TRAIN_BATCH):
        batch = slice(start, start + TRAIN_BATCH)
        rows = samples["rows"][batch]
        for j in range(TRAIN_STEPS):
            latents, next_latents = samples["latents"][batch, j], samples["latents"][batch, j + 1]
            sigma, sigma_next = sigmas[j].expand(TRAIN_BATCH), sigmas[j + 1].expand(TRAIN_BATCH)
            v = guided(transformer, latents, samples["timesteps"][batch, j], prompt_embeds[rows], pooled[rows],
                       embeds["negative"])
            step = flow_sde_step(latents, v, sigma, sigma_next, NOISE_LEVEL, prev_sample=next_latents)
            with torch.no_grad(), transformer.disable_adapter():
                v_ref = guided(transformer, latents, samples["timesteps"][batch, j], prompt_embeds[rows], pooled[rows],
                               embeds["negative"])
                reference = flow_sde_step(latents, v_ref, sigma, sigma_next, NOISE_LEVEL, prev_sample=next_latents)
            kl = ((step.mean - reference.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * step.std**2)
            ratio = torch.exp(step.log_prob - samples["log_probs"][batch, j])
            unclipped = -advantages[batch] * ratio
            clipped = -advantages[batch] * torch.clamp(ratio, 1 - CLIP_RANGE, 1 + CLIP_RANGE)
            loss = torch.mean(torch.maximum(unclipped, clipped)) + BETA * kl.mean()
            (loss / accumulation).backward()
            done += 1
            if done % accumulation == 0:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad()


def main(grpo_steps: int = 2, seed: int = 0, dtype=torch.float32, leancompile_wrap: bool = True):
    """Run ``grpo_steps`` rollouts and updates; returns the transformer and the mean reward of each rollout."""
    transformer, optimizer, embeds, latent_shape, reward = build(seed, dtype, leancompile_wrap)
    generator = torch.Generator().manual_seed(seed)
    means = []
    for _ in range(grpo_steps):
        transformer.eval()
        samples = rollout(transformer, embeds, latent_shape, generator, dtype)
        rewards = reward(samples["latents"][:, -1])
        means.append(float(rewards.mean()))
        transformer.train()
        train(transformer, optimizer, embeds, samples, rewards, dtype)
    return transformer, means


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native", action="store_true", help="run without leancompile")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    transformer, means = main(args.steps, leancompile_wrap=not args.native)
    print("mean reward per rollout:", ", ".join(f"{m:.4f}" for m in means))
    if not args.native:
        print("calls:", transformer.stats())
