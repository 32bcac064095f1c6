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

import torch

import leancompile

from .cases import backbone_sizes
from .public_loops import FlowGRPOFlux, Setup, advantages_of, flux_model

RUNS = ("native", "contiguous", "served", "bitwise")
RUN_NAMES = {"native": "native", "contiguous": "native, laid out as the rollout", "served": "served",
             "bitwise": "served, bitwise=True"}
SERVED = ("served", "bitwise")


def measure(setup: Setup) -> dict:
    """The three runs' ratios and first gradients, on the same weights, rollout and advantages."""
    base, model = flux_model(setup)
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
        advantages = advantages_of(rewards, setup).to(setup.device)
        ratios = loop.update(stacked, log_probs, advantages, contiguous=trajectory if run == "contiguous" else None)
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
