"""``python -m benchmarks.bf16_equivalence [--device cuda] [--tiny]``: how far a wrapped bf16 FlowGRPO-FLUX-style
update is from native's, against native's own bf16 rounding.

The loop is written as FlowGRPO's FLUX scripts write theirs: a diffusers Flux transformer in bf16 with peft LoRA
(adapter weights in float32, peft's default), called under bf16 autocast; the rollout samples a group of images
under ``no_grad`` in ``eval()`` with FlowGRPO's SDE step, passing a bf16 ``timestep`` and ``guidance``, and stores the
trajectory stacked as ``(batch, steps + 1, tokens, channels)`` in bf16 with each step's log-prob of the stored next
latents; the update, in ``train()``, recomputes each step's log-prob on the strided views ``latents[:, j]`` and
``latents[:, j + 1]`` with float32 ``timestep`` and ``guidance`` of equal values, takes PPO's clipped loss at clip
range 1e-5 and accumulates every step into the first optimizer step's gradient. Weights, rollout and advantages
are the same in every run. Measured, per weight layout (``bf16``: bf16 weights; ``fp32``: float32 weights under
the same autocast):

- ``native``: the update as written (strided views);
- ``native, laid out as the rollout``: the same update on the rollout's own contiguous tensors, same batch (what
  native would compute if it reproduced its rollout's layout): native's own rounding noise against ``native``;
- ``served``: the module wrapped with ``leancompile.wrap``; every update call is served from its rollout call;
- ``served, bitwise=True``: wrapped with ``leancompile.wrap(module, bitwise=True)``.

For each: the first optimizer step's importance ratio ``exp(logp - logp_old)`` (max and mean of ``|ratio - 1|``
over samples and steps, and the fraction clipped, i.e. ``|ratio - 1| > clip range``), and the gradient's relative
difference (``|g - g_ref| / |g_ref|``) and cosine against the other runs. ``--device cuda`` runs on the GPU under
CUDA autocast at the GPU sizes of benchmarks/cases.py; otherwise the CPU under CPU autocast at the quick sizes.
``--tiny`` uses the test suite's tiny Flux (tests/test_bf16_equivalence.py asserts on these figures).
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model

import leancompile
from leancompile import backbones
from leancompile.trainers.sampling import flow_sde_step, shifted_sigmas

from .cases import backbone_sizes

RUNS = ("native", "contiguous", "served", "bitwise")
RUN_NAMES = {"native": "native", "contiguous": "native, laid out as the rollout", "served": "served",
             "bitwise": "served, bitwise=True"}
SERVED = ("served", "bitwise")


@dataclass(frozen=True)
class Setup:
    sizes: tuple = ()  # overrides of the tiny Flux config, as (key, value) pairs
    weights: str = "bf16"  # "bf16": bf16 weights; "fp32": float32 weights (both under bf16 autocast)
    num_steps: int = 4  # denoising steps, all trained
    prompts: int = 2
    group: int = 4
    eta: float = 0.7
    guidance: float = 3.5
    clip_range: float = 1e-5
    adv_clip_max: float = 5.0
    lora_rank: int = 4
    seed: int = 0
    device: str = "cpu"


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

    def call(self, latents, sigma):
        """One transformer call as FlowGRPO's FLUX scripts make it: ``sigma`` and the guidance in its dtype."""
        rows = latents.shape[0]
        return self.transformer(hidden_states=latents, encoder_hidden_states=self.embeds, pooled_projections=self.pooled,
                                timestep=sigma.expand(rows), guidance=torch.full((rows,), self.setup.guidance,
                                                                                 dtype=sigma.dtype, device=sigma.device),
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

    def update(self, stacked, log_probs_old, advantages, contiguous=None):
        """The first optimizer step's micro-steps: each step's log-prob recomputed on ``stacked[:, j]`` (or on the
        rollout's own ``contiguous[j]``), PPO's clipped loss, one backward per step. Returns the ratios
        ``(batch, steps)``."""
        s = self.setup
        self.transformer.train()
        ratios = []
        timesteps = self.sigmas[:-1].expand(len(stacked), -1)  # stored as the sampler made them, float32
        with torch.autocast(s.device, dtype=torch.bfloat16):
            for j in range(s.num_steps):
                x = stacked[:, j] if contiguous is None else contiguous[j]
                x_next = stacked[:, j + 1] if contiguous is None else contiguous[j + 1]
                v = self.call(x, timesteps[:, j]).float()
                lp = flow_sde_step(x.float(), v, timesteps[:, j], self.sigmas[j + 1].expand(len(v)), s.eta,
                                   prev_sample=x_next.float()).log_prob
                ratio = torch.exp(lp - log_probs_old[:, j])
                unclipped = -advantages * ratio
                clipped = -advantages * torch.clamp(ratio, 1 - s.clip_range, 1 + s.clip_range)
                (torch.maximum(unclipped, clipped).mean() / s.num_steps).backward()
                ratios.append(ratio.detach())
        return torch.stack(ratios, dim=1)


def _advantages(rewards: torch.Tensor, setup: Setup) -> torch.Tensor:
    grouped = rewards.reshape(setup.prompts, setup.group)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-4)
    return adv.clamp(-setup.adv_clip_max, setup.adv_clip_max).flatten()


def _model(setup: Setup):
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


def measure(setup: Setup) -> dict:
    """The three runs' ratios and first gradients, on the same weights, rollout and advantages."""
    base, model = _model(setup)
    conditioning = base.dummy_conditioning(setup.prompts, torch.Generator().manual_seed(setup.seed), torch.bfloat16)
    figures = {}
    for run in RUNS:
        module = copy.deepcopy(model)
        transformer = leancompile.wrap(module, bitwise=run == "bitwise") if run in SERVED else module
        loop = FlowGRPOFlux(setup, transformer, base, (conditioning.text, conditioning.pooled))
        loop.generator = torch.Generator().manual_seed(setup.seed + 2)
        rows = setup.prompts * setup.group
        noise = torch.randn((rows, loop.tokens, loop.channels), generator=loop.generator).to(setup.device)
        stacked, log_probs, trajectory = loop.rollout(noise)
        rewards = -stacked[:, -1].float().square().mean(dim=(1, 2)).cpu()  # any reward that differs per sample
        advantages = _advantages(rewards, setup).to(setup.device)
        ratios = loop.update(stacked, log_probs, advantages, trajectory if run == "contiguous" else None)
        deviation = (ratios.double() - 1).abs()
        grad = torch.cat([p.grad.flatten().double() for p in module.parameters() if p.requires_grad]).cpu()
        figures[run] = dict(trajectory=stacked.cpu(), max_deviation=float(deviation.max()),
                            mean_deviation=float(deviation.mean()),
                            clipped=float((deviation > setup.clip_range).double().mean()), grad=grad)
        if run in SERVED:
            stats = transformer.stats()
            figures[run].update(served_calls=stats["served_calls"], recomputed_calls=stats["recomputed_calls"],
                                update_calls=setup.num_steps)
    for a, b in (("native", "contiguous"), ("served", "native"), ("served", "contiguous"), ("bitwise", "native"),
                 ("bitwise", "contiguous")):
        ga, gb = figures[a]["grad"], figures[b]["grad"]
        figures[f"{a}~{b}"] = dict(relative=float((ga - gb).norm() / gb.norm()),
                                   cosine=float(torch.nn.functional.cosine_similarity(ga, gb, dim=0)))
    return figures


def markdown(rows: list[tuple[str, dict]]) -> str:
    lines = ["| weights | run | max abs(ratio - 1) | mean abs(ratio - 1) | clipped at 1e-5 | gradient vs native "
             "(rel. diff, cosine) | gradient vs native laid out as the rollout (rel. diff, cosine) |",
             "|---|---|---|---|---|---|---|"]
    cell = "{relative:.2e}, {cosine:.6f}".format
    for weights, f in rows:
        for run in RUNS:
            to_native = "native~contiguous" if run == "contiguous" else f"{run}~native"
            to_contiguous = "native~contiguous" if run == "native" else f"{run}~contiguous"
            vs_native = "-" if run == "native" else cell(**f[to_native])
            vs_contiguous = "-" if run == "contiguous" else cell(**f[to_contiguous])
            r = f[run]
            lines.append(f"| {weights} | {RUN_NAMES[run]} | {r['max_deviation']:.2e} | {r['mean_deviation']:.2e} | "
                         f"{r['clipped']:.1%} | {vs_native} | {vs_contiguous} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bf16_equivalence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tiny", action="store_true", help="the test suite's tiny Flux instead of the benchmark's")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    sizes = () if args.tiny else tuple(backbone_sizes("flux", device=args.device).items())
    rows = []
    for weights in ("bf16", "fp32"):
        setup = Setup(sizes=sizes, weights=weights, device=args.device)
        figures = measure(setup)
        for run in SERVED:
            served = figures[run]
            print(f"{weights} weights, {RUN_NAMES[run]}: {served['served_calls']} of {served['update_calls']} update "
                  f"calls served, {served['recomputed_calls']} recomputed", file=sys.stderr)
        rows.append((weights, figures))
    print(f"FlowGRPO-FLUX-style bf16 loop on {args.device} ({'tiny' if args.tiny else 'benchmark'} Flux, LoRA rank "
          f"{setup.lora_rank}, {setup.prompts} prompts x {setup.group} samples, {setup.num_steps} steps trained, "
          f"clip range {setup.clip_range:g}):\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
